"""Expert parallel (EngineArgs.enable_expert_parallel): under TP=t each rank holds whole experts
[r*E//t, (r+1)*E//t) (uneven when t does not divide E) instead of a slice of every expert; the
ranks' partial outputs sum (one all-reduce) to TP=1's. In process: the ranks' expert layers
summed equal the full layer, and each rank reads only its experts. Two real processes over gloo:
greedy tokens equal TP=1's (slow)."""

from __future__ import annotations

import dataclasses
import os
import signal

import pytest
import torch
from models.tiny_archs import make_checkpoint

from pdcluster import LLM, SamplingParams
from pdcluster.config import EngineArgs
from pdcluster.models.hf_config import load_model_config
from pdcluster.models.layers.fused_moe import FusedMoE
from pdcluster.models.layers.torch_attention import TorchAttentionBackend
from pdcluster.models.loader import load_model

CASES = {
    "qwen3moe-e5k3": ("qwen3_moe", {"num_experts": 5, "num_experts_per_tok": 3, "moe_intermediate_size": 20}),
    "mixtral-e3k2": ("mixtral", {"num_local_experts": 3, "num_experts_per_tok": 2, "intermediate_size": 36}),
    "qwen2moe-e7k1-shared": ("qwen2_moe", {"num_experts": 7, "num_experts_per_tok": 1, "norm_topk_prob": True,
                                           "moe_intermediate_size": 18, "shared_expert_intermediate_size": 24}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe-ep")
    return {case: make_checkpoint(arch, root / case, **kw) for case, (arch, kw) in CASES.items()}


class _Collect:
    """Stands in for the all-reduce: keeps each rank's partial sum."""

    def __init__(self) -> None:
        self.parts: list[torch.Tensor] = []

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self.parts.append(t.clone())
        return t


@pytest.mark.parametrize("case", list(CASES))
def test_expert_parallel_ranks_sum_to_tp1(checkpoints: dict[str, str], case: str) -> None:
    """Whole models loaded per rank (TP=2): each rank's experts are the full layer's."""
    tp = 2
    cfg = load_model_config(checkpoints[case])
    ep = dataclasses.replace(cfg, expert_parallel=True)
    full = next(m for m in load_model(cfg, TorchAttentionBackend()).modules() if isinstance(m, FusedMoE))
    x = torch.randn(13, cfg.hidden_size)
    with torch.no_grad():
        logits = torch.randn(13, cfg.num_experts)
        weights, ids = full._ops.moe_router(logits, cfg.num_experts_per_tok, "softmax", True)
        want = full(x, weights, ids)
        total, owned = torch.zeros_like(want), []
        for rank in range(tp):
            model = load_model(ep, TorchAttentionBackend(), tp_rank=rank, tp_size=tp)
            experts = next(m for m in model.modules() if isinstance(m, FusedMoE))
            assert experts.w13_weight.shape == (experts.last_expert - experts.first_expert,
                                                2 * cfg.moe_intermediate_size, cfg.hidden_size)
            # Its experts hold the full layer's weights for them.
            torch.testing.assert_close(experts.w2_weight, full.w2_weight[experts.first_expert:experts.last_expert])
            owned += list(range(experts.first_expert, experts.last_expert))
            experts.tp_group = hook = _Collect()
            experts(x, weights, ids)
            total += hook.parts[0]
    assert owned == list(range(cfg.num_experts))  # a partition of the experts
    torch.testing.assert_close(total, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("num_experts", "top_k", "tp"), [(5, 2, 3), (4, 4, 4), (9, 3, 4), (6, 1, 5)])
def test_expert_layers_partition_and_sum(num_experts: int, top_k: int, tp: int) -> None:
    """The experts layer alone, fed per-expert checkpoint tensors through its weight loader."""
    from pdcluster.kernels.ops import get_ops

    torch.manual_seed(num_experts * 10 + tp)
    hidden, inter, ops = 12, 10, get_ops("torch")
    parts = {(e, p): torch.randn(inter, hidden) if p < 2 else torch.randn(hidden, inter)
             for e in range(num_experts) for p in range(3)}

    def build(rank: int, size: int, ep: bool) -> FusedMoE:
        layer = FusedMoE(num_experts, hidden, inter, torch.float32, ops, rank, size, expert_parallel=ep)
        for (e, p), t in parts.items():
            param = layer.w2_weight if p == 2 else layer.w13_weight
            layer.weight_loader(param, t, (e, p))
        return layer

    x = torch.randn(17, hidden)
    weights, ids = ops.moe_router(torch.randn(17, num_experts), top_k, "softmax", True)
    want = build(0, 1, False)(x, weights, ids)
    total, owned = torch.zeros_like(want), []
    for rank in range(tp):
        layer = build(rank, tp, True)
        owned += list(range(layer.first_expert, layer.last_expert))
        layer.tp_group = hook = _Collect()
        layer(x, weights, ids)
        total += hook.parts[0]
    assert owned == list(range(num_experts))
    torch.testing.assert_close(total, want, atol=1e-5, rtol=1e-5)


def test_expert_parallel_options(checkpoints: dict[str, str]) -> None:
    path = checkpoints["mixtral-e3k2"]

    def config(**kw):
        return EngineArgs(model=path, device="cpu", num_kv_blocks=32, **kw).create_engine_config()

    assert not config(enable_expert_parallel=True).model.expert_parallel  # TP=1: nothing to partition
    with pytest.raises(ValueError, match="enable_expert_parallel"):
        config(enable_expert_parallel="yes")
    with pytest.raises(ValueError, match="3 experts cannot be partitioned"):
        config(enable_expert_parallel=True, tensor_parallel_size=4)


PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 50)), [42, 17, 300, 2, 11]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ENGINE = {"num_kv_blocks": 48, "max_num_batched_tokens": 32}


@pytest.fixture
def started_pids():
    from distributed.tp_procs import alive

    pids: list[int] = []
    yield pids
    for pid in pids:  # by pid, whatever the outcome
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.slow
@pytest.mark.parametrize("case", ["qwen3moe-e5k3", "qwen2moe-e7k1-shared"])
def test_expert_parallel_tp2_equals_tp1(checkpoints: dict[str, str], started_pids: list[int], case: str) -> None:
    from distributed.tp_procs import wait_dead

    path = checkpoints[case]
    ref = [o.outputs[0].token_ids for o in LLM(path, **ENGINE).generate(PROMPTS, GREEDY)]
    llm = LLM(path, tensor_parallel_size=2, enable_expert_parallel=True, **ENGINE)
    runner = llm.engine.core.runner
    pids = list(runner.pids.values())
    started_pids.extend(pids)
    try:
        assert llm.engine.config.model.expert_parallel
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == ref
        experts = next(m for m in runner.runner.model.modules() if isinstance(m, FusedMoE))
        cfg = llm.engine.config.model
        assert experts.w2_weight.shape == (cfg.num_experts // 2, cfg.hidden_size, cfg.moe_intermediate_size)
    finally:
        llm.engine.shutdown()
    assert wait_dead(pids, 10.0) == []


def test_worker_flag_enable_expert_parallel() -> None:
    """serve-worker takes vLLM's --enable-expert-parallel and hands it to EngineArgs."""
    import argparse

    from pdcluster.cluster.worker_flags import add_engine_flags, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert engine_kwargs(parser.parse_args(["--enable-expert-parallel"]))["enable_expert_parallel"] is True
    assert engine_kwargs(parser.parse_args([]))["enable_expert_parallel"] is False
