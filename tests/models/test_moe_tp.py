"""MoE under tensor parallelism: TP=2 (two real processes over gloo) gives TP=1's tokens; each
rank holds every expert with half its intermediate dim (the all-reduce the dense MLP uses)."""

from __future__ import annotations

import os
import signal

import pytest
from distributed.tp_procs import alive, wait_dead
from models.tiny_archs import make_checkpoint

from pdcluster import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 50)), [42, 17, 300, 2, 11]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ENGINE = {"num_kv_blocks": 48, "max_num_batched_tokens": 32}


@pytest.fixture
def started_pids():
    pids: list[int] = []
    yield pids
    for pid in pids:  # by pid, whatever the outcome
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.parametrize(("arch", "overrides"), [
    ("qwen2_moe", {"num_experts": 5, "num_experts_per_tok": 2, "mlp_only_layers": [1]}),
    ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 12}),
], ids=["qwen2moe-shared", "mixtral-window"])
def test_moe_tp2_equals_tp1(tmp_path, started_pids, arch: str, overrides: dict) -> None:
    path = make_checkpoint(arch, tmp_path / arch, **overrides)
    ref = [o.outputs[0].token_ids for o in LLM(path, **ENGINE).generate(PROMPTS, GREEDY)]
    llm = LLM(path, tensor_parallel_size=2, **ENGINE)
    runner = llm.engine.core.runner
    pids = list(runner.pids.values())
    started_pids.extend(pids)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == ref
        experts = next(layer.mlp.experts for layer in runner.runner.model.model.layers if hasattr(layer.mlp, "experts"))
        cfg = llm.engine.config.model
        assert experts.w2_weight.shape == (cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size // 2)
    finally:
        llm.engine.shutdown()
    assert wait_dead(pids, 10.0) == []
