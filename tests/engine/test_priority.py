"""vLLM's --scheduling-policy priority through the offline engine: one request at a time
(max_num_seqs=1), so the order in which requests produce their first token is the order the
scheduler admitted them: lower priority first, arrival order among equals. Outputs are those of
the fcfs engine; an fcfs engine refuses a priority by name."""

from __future__ import annotations

import pytest
from bytelevel_tiny import make_bytelevel_checkpoint

from pdcluster import LLM, SamplingParams

PROMPTS = ["alpha", "beta", "gamma", "delta"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return make_bytelevel_checkpoint(tmp_path_factory.mktemp("bl") / "m")


def _first_token_order(llm: LLM, priorities: list[int]) -> tuple[list[str], dict[str, list[int]]]:
    engine = llm.engine
    ids = {}
    for prompt, prio in zip(PROMPTS, priorities):
        ids[engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True,
                                                      priority=prio))] = prompt
    order: list[str] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if ids[out.request_id] not in order:
                order.append(ids[out.request_id])
    return order, {p: list(engine.get_final(rid).outputs[0].token_ids) for rid, p in ids.items()}


def test_lower_priority_first_then_arrival(model):
    llm = LLM(model, max_model_len=128, max_num_seqs=1, scheduling_policy="priority")
    order, outs = _first_token_order(llm, [3, 1, 1, -2])
    assert order == ["delta", "beta", "gamma", "alpha"]
    fcfs = LLM(model, max_model_len=128, max_num_seqs=1)
    fcfs_order, fcfs_outs = _first_token_order(fcfs, [0, 0, 0, 0])
    assert fcfs_order == PROMPTS and fcfs_outs == outs  # the order changes, never the tokens
    # vLLM's LLM.generate(priority=[...]): outputs in prompt order whatever the schedule.
    got = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), priority=[1, 0, 2, 0])
    assert [list(o.outputs[0].token_ids) for o in got] == [fcfs_outs[p] for p in PROMPTS]
    with pytest.raises(ValueError, match="priority has 1 entries for 4 prompts"):
        llm.generate(PROMPTS, priority=[1])
    with pytest.raises(ValueError, match=r"priority=1: this engine schedules first come, first served"):
        fcfs.generate(["x"], SamplingParams(priority=1))
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        LLM(model, scheduling_policy="lifo")
    with pytest.raises(ValueError, match="priority must be in"):
        SamplingParams(priority=2**31)
