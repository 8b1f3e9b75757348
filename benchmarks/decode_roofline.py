"""Batch-1 decode against the memory roofline: ms per token vs the time it takes just to read the
bytes one decode step must read (every weight matrix once, plus the request's KV cache), at this
machine's measured read bandwidth.

    python benchmarks/decode_roofline.py                      # 125M bench Llama, bf16 checkpoint
    python benchmarks/decode_roofline.py --prompt-len 512 --steps 64 --compute-dtype float32
    python benchmarks/decode_roofline.py --enforce-eager      # without torch.compile
    PDCLUSTER_CPU_PREPACK=0 python benchmarks/decode_roofline.py   # F.linear, no oneDNN pre-packing
    PDCLUSTER_CPU_GEMV=0 python benchmarks/decode_roofline.py      # no bf16 decode copies

Bandwidth: the best of several full reads (torch.sum) of a buffer far larger than the caches, with
the engine's thread count; a copy (read + write) is printed beside it. Decode: one request driven
through ModelRunner directly (prefill, then timed single-token steps: the whole step, runner
input building and sampling included), median of the steps. Printed beside it: how many linear
weights run oneDNN pre-packed (models/layers/cpu_gemm.py) and how many read a bfloat16 decode
copy (models/layers/cpu_gemv.py: the bytes per step count that copy, not the float32 weight, and
the float32 weights' roofline is printed beside), the process CPU time per step (the machine may
be shared: CPU time above threads x wall time means waiting) and the load average.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_model import ensure_bench_model  # noqa: E402

# Steady-state speed: the engine compiles before it serves, not on its background thread
# (engine/compiled_forward.py); child processes (servers, workers) inherit it.
os.environ.setdefault("PDCLUSTER_COMPILE_START", "wait")


def read_bandwidth(nbytes: int, repeats: int = 5) -> tuple[float, float]:
    """(read GB/s, copy GB/s counting read + write), best of `repeats`."""
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    best_read = best_copy = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        src.sum()
        best_read = min(best_read, time.perf_counter() - t0)
        t0 = time.perf_counter()
        dst.copy_(src)
        best_copy = min(best_copy, time.perf_counter() - t0)
    return nbytes / best_read / 1e9, 2 * nbytes / best_copy / 1e9


def bytes_per_step(model, kv_itemsize: int, cfg, seq_len: int) -> tuple[int, int, int]:
    """(weight bytes a batch-1 decode step reads, KV bytes read, weight bytes at the compute
    dtype). The input embedding reads one row. A module with a bfloat16 decode copy
    (models/layers/cpu_gemv.py) reads that copy instead of its float32 weight."""
    weights = 0
    for name, p in model.named_parameters():  # a tied LM head is listed once, read in full
        untied_embedding = name.endswith("embed_tokens.weight") and not cfg.tie_word_embeddings
        weights += (p[0].numel() if untied_embedding else p.numel()) * p.element_size()
    # A packed layer's plain weight is released (numel 0): the step reads its packed copy instead.
    weights += sum(getattr(m, "released_weight_bytes", 0) for m in model.modules())
    at_compute_dtype = weights
    for m in model.modules():
        copy = getattr(m, "gemv_weight", None)
        if copy is not None:
            full = m.weight.numel() * m.weight.element_size() or getattr(m, "released_weight_bytes", 0)
            weights += copy.nbytes - full
    kv = 2 * cfg.num_hidden_layers * seq_len * cfg.num_key_value_heads * cfg.head_dim * kv_itemsize
    return weights, kv, at_compute_dtype


def decode_ms(model_path: str, compute_dtype: str, prompt_len: int, steps: int,
              enforce_eager: bool = False) -> tuple[float, float, object]:
    """(median ms per decode step, mean process CPU ms per step, the runner)."""
    import torch

    from pdcluster.config import EngineArgs
    from pdcluster.engine.model_runner import ModelRunner
    from pdcluster.engine.outputs import CachedRequestData, NewRequestData, SchedulerOutput
    from pdcluster.sampling_params import SamplingParams

    block_size = 16
    num_blocks = (prompt_len + steps) // block_size + 2
    cfg = EngineArgs(model=model_path, compute_dtype=compute_dtype, block_size=block_size,
                     num_kv_blocks=num_blocks + 1, max_model_len=prompt_len + steps + 1,
                     device="cpu", enforce_eager=enforce_eager).create_engine_config()
    runner = ModelRunner(cfg)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    prompt = [3 + (i * 7919) % 30000 for i in range(prompt_len)]
    runner.execute(SchedulerOutput([NewRequestData("r", prompt, [], params, list(range(num_blocks)), 0)], [],
                                   {"r": prompt_len}, prompt_len))
    times = []
    cpu0 = time.process_time()
    with torch.inference_mode():
        for i in range(steps):
            so = SchedulerOutput([], [CachedRequestData("r", [], prompt_len + i)], {"r": 1}, 1)
            t0 = time.perf_counter()
            runner.execute(so)
            times.append(time.perf_counter() - t0)
    cpu_ms = 1e3 * (time.process_time() - cpu0) / steps
    return 1e3 * statistics.median(times[2:] or times), cpu_ms, runner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=os.path.expanduser("~/.cache/pdcluster/bench-llama-125m"))
    parser.add_argument("--compute-dtype", default="auto")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--buffer-mib", type=int, default=1024)
    parser.add_argument("--enforce-eager", action="store_true", help="no torch.compile of the forward")
    args = parser.parse_args()
    import torch

    if os.environ.get("PDCLUSTER_NUM_THREADS"):
        torch.set_num_threads(int(os.environ["PDCLUSTER_NUM_THREADS"]))
    model = ensure_bench_model(args.model_dir)
    read_gbs, copy_gbs = read_bandwidth(args.buffer_mib << 20)
    ms, cpu_ms, runner = decode_ms(model, args.compute_dtype, args.prompt_len, args.steps, args.enforce_eager)
    cfg = runner.config.model
    weights, kv, full_weights = bytes_per_step(runner.model, runner.kv_caches.element_size(), cfg,
                                               args.prompt_len + args.steps // 2)
    floor_ms = 1e3 * (weights + kv) / (read_gbs * 1e9)
    full_floor_ms = 1e3 * (full_weights + kv) / (read_gbs * 1e9)
    compiled = type(runner.forward_fn).__name__ == "CompiledForward"
    from pdcluster.models.layers.cpu_gemm import packed_count
    from pdcluster.models.layers.cpu_gemv import copy_count

    packed, linears = packed_count(runner.model)
    copies, copy_bytes = copy_count(runner.model)
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "default")
    tuner = runner.thread_tuner  # decode steps' thread count from their timings (engine/thread_tuner.py)
    threads = tuner.max_threads if tuner is not None else torch.get_num_threads()
    if tuner is not None:
        means = tuner.snapshot().get(1, {})
        print("thread tuner (batch 1): mean step ms by thread count "
              + ", ".join(f"{n}: {1e3 * t:.2f}" for n, t in sorted(means.items(), reverse=True))
              + f"; chose {tuner.best(1)}")
    print(f"threads={threads} compute_dtype={cfg.dtype} kv={runner.kv_caches.dtype} compiled={compiled} "
          f"prepacked={packed}/{linears} bf16_decode_copies={copies} ({copy_bytes / 1e6:.1f} MB) "
          f"onednn_isa={isa} load={os.getloadavg()[0]:.1f}")
    print(f"bandwidth: read {read_gbs:.1f} GB/s (sum of {args.buffer_mib} MiB), copy {copy_gbs:.1f} GB/s (r+w)")
    print(f"bytes per step: weights {weights / 1e6:.1f} MB + KV {kv / 1e6:.2f} MB at ~{args.prompt_len} tokens"
          + (f" (weights at {cfg.dtype}: {full_weights / 1e6:.1f} MB, roofline {full_floor_ms:.2f} ms)"
             if full_weights != weights else ""))
    print(f"batch-1 decode: {ms:.2f} ms/token; roofline {floor_ms:.2f} ms/token -> "
          f"{100 * floor_ms / ms:.0f}% of the memory roofline ({(weights + kv) / ms / 1e6:.1f} GB/s achieved); "
          f"process CPU {cpu_ms:.2f} ms/step")


if __name__ == "__main__":
    main()
