"""SamplingParams.prompt_logprobs against transformers: every prompt token after the first gets
the logprob and rank of transformers' log-softmax at the position before it, and the top-n
alternatives, under every scheduling the engine does (chunked prefill, a prompt already in the
prefix cache, preemption and recompute, batches mixing requests that ask and ones that do not)."""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from tiny_models import make_tiny_checkpoint

from pdcluster import LLM, SamplingParams
from pdcluster.engine.request import Request

LENS = (1, 2, 9, 23, 40)
TOP = 3


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory):
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("plp") / "llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(3)
    prompts = [[rng.randrange(3, hf.config.vocab_size) for _ in range(n)] for n in LENS]
    want = []
    for p in prompts:
        with torch.no_grad():
            want.append(torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), dim=-1))
    return path, prompts, want


def _check(outputs, prompts, want) -> None:
    for out, p, lp in zip(outputs, prompts, want):
        entries = out.prompt_logprobs
        assert entries is not None and len(entries) == len(p) - 1
        for pos, e in enumerate(entries):  # entry pos scores prompt token pos + 1 from position pos
            row = lp[pos]
            assert e.sampled.token_id == p[pos + 1]
            assert e.sampled.logprob == pytest.approx(row[p[pos + 1]].item(), abs=2e-4)
            assert e.sampled.rank == int((row > row[p[pos + 1]]).sum()) + 1
            top_vals, top_ids = row.topk(TOP)
            assert [t.token_id for t in e.top] == top_ids.tolist()
            assert [t.logprob for t in e.top] == pytest.approx(top_vals.tolist(), abs=2e-4)
            assert [t.rank for t in e.top] == [1, 2, 3]


@pytest.mark.parametrize("opts", [
    dict(),
    dict(max_num_batched_tokens=8),                        # every prompt scored over several chunks
    dict(block_size=4, num_kv_blocks=34, max_num_batched_tokens=64),  # preempted and recomputed
], ids=["plain", "chunk8", "preemption"])
def test_prompt_logprobs_equal_transformers(case, opts: dict) -> None:
    path, prompts, want = case
    llm = LLM(path, dtype="float32", max_model_len=128, **opts)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=TOP)
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    baseline = [o.outputs[0].token_ids for o in llm.generate(prompts, plain)]  # also fills the prefix cache
    for _ in range(2):  # the prompts are cached now: prompt logprobs must not use the cache
        outs = llm.generate(prompts + prompts, [params] * len(prompts) + [plain] * len(prompts))
        _check(outs[:len(prompts)], prompts, want)
        assert all(o.prompt_logprobs is None for o in outs[len(prompts):])
        assert [o.outputs[0].token_ids for o in outs] == baseline + baseline  # the outputs are unchanged
    stats = llm.engine.get_stats()
    assert stats["num_running"] == 0 and stats["kv_blocks_used"] == 0
    if opts.get("num_kv_blocks"):
        assert stats["num_preemptions"] > 0


def test_a_leg_that_does_not_compute_the_prompt_refuses_them(case) -> None:
    path, prompts, _ = case
    llm = LLM(path, dtype="float32", max_model_len=128)
    params = SamplingParams(max_tokens=4, prompt_logprobs=1)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.engine.prepare_request(prompts[3], params, prefill_output_token_ids=[5])


def test_entries_are_kept_once_across_a_recompute() -> None:
    req = Request("r", [1, 2, 3, 4, 5], SamplingParams(prompt_logprobs=0))
    entries = [object() for _ in range(4)]  # stand-ins: only their order matters here
    req.add_prompt_logprobs(1, entries[:2])
    req.add_prompt_logprobs(1, [object(), object(), entries[2]])  # recomputed from the start
    req.add_prompt_logprobs(4, entries[3:])
    assert req.take_prompt_logprobs() == entries
    assert req.take_prompt_logprobs() is None and not req.prompt_logprobs_pending
    with pytest.raises(RuntimeError):
        gap = Request("g", [1, 2, 3, 4], SamplingParams(prompt_logprobs=0))
        gap.add_prompt_logprobs(3, [object()])
    assert Request("c", [1, 2], SamplingParams(prompt_logprobs=0), output_token_ids=[7]).prompt_logprobs is None
