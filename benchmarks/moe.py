"""MoE decode step time: the grouped experts path (kernels/fused_moe.py) vs a naive loop over tokens.

    python benchmarks/moe.py            # table (CPU: torch grouped path; CUDA: also the Triton one)
    python benchmarks/moe.py --json

Two measurements on a tiny Qwen3-MoE-shaped config (E experts, top-k, hidden H, expert size I):
  layer   one MoE experts layer for a decode batch of T tokens (T*k (token, expert) pairs);
  model   a whole decode step of a tiny random Qwen3-MoE model (ModelRunner, torch backend), with
          its experts run grouped or by the naive loop.
The naive loop is what "not grouped" means: for each token, for each of its k experts, two
matrix-vector products. Times are medians of perf_counter (CUDA synchronised); CPU runs use one
thread so a shared, loaded machine disturbs them less.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pdcluster.kernels.fused_moe import fused_moe_torch
from pdcluster.kernels.moe_router import moe_router_torch

CONFIG = {"num_experts": 8, "num_experts_per_tok": 2, "hidden_size": 256, "moe_intermediate_size": 128}


def naive_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = F.linear(hidden[t], w13[e]).chunk(2)
            out[t] += weights[t, j].to(hidden.dtype) * F.linear(F.silu(gate) * up, w2[e])
    return out


def median_ms(fn: Callable[[], object], device: torch.device, reps: int = 20) -> float:
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def bench_layer(device: torch.device, batch: int) -> dict[str, float | int | str]:
    e, k, h, i = (CONFIG[n] for n in ("num_experts", "num_experts_per_tok", "hidden_size", "moe_intermediate_size"))
    x = torch.randn(batch, h, device=device)
    w13, w2 = torch.randn(e, 2 * i, h, device=device) / h**0.5, torch.randn(e, h, i, device=device) / i**0.5
    weights, ids = moe_router_torch(torch.randn(batch, e, device=device), k)
    row: dict[str, float | int | str] = {"what": "layer", "tokens": batch,
                                         "naive_ms": median_ms(lambda: naive_moe(x, w13, w2, weights, ids), device),
                                         "grouped_ms": median_ms(lambda: fused_moe_torch(x, w13, w2, weights, ids),
                                                                 device)}
    if device.type == "cuda":
        from pdcluster.kernels.fused_moe import fused_moe_triton

        row["triton_ms"] = median_ms(lambda: fused_moe_triton(x, w13, w2, weights, ids), device)
    return row


def bench_model(batch: int) -> dict[str, float | int | str]:
    """A decode step of `batch` requests (context 16) through a tiny Qwen3-MoE on CPU."""
    import transformers

    from pdcluster.config import EngineArgs
    from pdcluster.engine.model_runner import ModelRunner
    from pdcluster.engine.outputs import CachedRequestData, NewRequestData, SchedulerOutput
    from pdcluster.sampling_params import SamplingParams

    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as path:
        cfg = transformers.Qwen3MoeConfig(
            vocab_size=512, hidden_size=CONFIG["hidden_size"], intermediate_size=512, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, num_experts=CONFIG["num_experts"],
            num_experts_per_tok=CONFIG["num_experts_per_tok"], moe_intermediate_size=CONFIG["moe_intermediate_size"],
            max_position_embeddings=256)
        torch.manual_seed(0)
        transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(path)
        config = EngineArgs(model=path, block_size=16, num_kv_blocks=3 * batch + 8, device="cpu",
                            attention_backend="torch", ops_backend="torch").create_engine_config()
        runner = ModelRunner(config)
        params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
        new = [NewRequestData(f"r{b}", list(range(3, 19)), [], params, [3 * b, 3 * b + 1, 3 * b + 2], 0) for b in range(batch)]
        runner.execute(SchedulerOutput(new, [], {f"r{b}": 16 for b in range(batch)}, 16 * batch))
        computed = [16]

        def step() -> None:  # one decode token per request; contexts stay inside their three blocks
            cached = [CachedRequestData(f"r{b}", [], computed[0]) for b in range(batch)]
            runner.execute(SchedulerOutput([], cached, {f"r{b}": 1 for b in range(batch)}, batch))
            computed[0] += 1

        grouped = median_ms(step, torch.device("cpu"), reps=8)
        for layer in runner.model.model.layers:
            layer.mlp.experts._ops = dataclasses.replace(layer.mlp.experts._ops, fused_moe=naive_moe)
        naive = median_ms(step, torch.device("cpu"), reps=8)
    return {"what": "model", "tokens": batch, "naive_ms": naive, "grouped_ms": grouped}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)
    rows = [bench_layer(device, b) for b in args.batches] + [bench_model(b) for b in args.batches[1:3]]
    if args.json:
        print(json.dumps({"device": str(device), "config": CONFIG, "rows": rows}))
        return
    print(f"device {device}; config {CONFIG}")
    print(f"{'what':6} {'tokens':>6} {'naive ms':>10} {'grouped ms':>11} {'speedup':>8}" +
          (f" {'triton ms':>10}" if device.type == "cuda" else ""))
    for r in rows:
        line = (f"{r['what']:6} {r['tokens']:>6} {r['naive_ms']:>10.3f} {r['grouped_ms']:>11.3f} "
                f"{r['naive_ms'] / r['grouped_ms']:>7.1f}x")
        print(line + (f" {r['triton_ms']:>10.3f}" if "triton_ms" in r else ""))


if __name__ == "__main__":
    main()
