"""Kernel benchmark: achieved bandwidth / FLOP/s of every kernel next to the device's own peaks.

    python benchmarks/kernels.py            # table
    python benchmarks/kernels.py --json     # machine-readable rows

Peaks are measured, not looked up: "copy" is a large device-to-device tensor copy (bytes read +
written per second), "matmul" a large half-precision GEMM (float32 on CPU). Memory-bound kernels
report GB/s as a fraction of copy bandwidth, attention prefill TFLOP/s as a fraction of matmul
and, on CUDA, against torch SDPA. On CUDA every kernel runs as Triton and as its torch reference;
on CPU only the references run (Triton needs a GPU; its CPU interpreter is a test tool, not a
target), at smaller shapes. Times are medians: triton.testing.do_bench on CUDA, perf_counter on CPU.

Targets on H200: decode attention >= 70% of copy bandwidth at long contexts, prefill attention
>= 0.9x torch SDPA, norm / rope / silu / cache write / pack >= 80% of copy bandwidth.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from pdcluster.kernels import (
    extend_attention_torch,
    extend_attention_triton,
    fused_add_rms_norm_torch,
    fused_add_rms_norm_triton,
    moe_router_torch,
    moe_router_triton,
    pack_kv_blocks_torch,
    pack_kv_blocks_triton,
    pack_shape,
    paged_decode_attention_torch,
    paged_decode_attention_triton,
    reshape_and_cache_torch,
    reshape_and_cache_triton,
    rms_norm_torch,
    rms_norm_triton,
    rotary_embedding_torch,
    rotary_embedding_triton,
    silu_and_mul_torch,
    silu_and_mul_triton,
)

DT = torch.bfloat16  # model dtype of every case
ESZ = 2  # its element size in bytes


@dataclass
class Row:
    kernel: str
    shape: str
    impl: str
    time_us: float
    metric: str  # "GB/s" or "TFLOP/s"
    achieved: float
    of_peak: float  # fraction of copy bandwidth (GB/s rows) or matmul peak (TFLOP/s rows)
    target: str


def bench(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds per call."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=max(100, repeats * 10), return_mode="median") / 1e3
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_peaks(device: torch.device, repeats: int) -> tuple[float, float]:
    """-> (copy bandwidth in bytes/s, matmul FLOP/s)."""
    numel = (1 << 28) if device.type == "cuda" else (1 << 24)  # 1 GiB / 64 MiB of float32
    src = torch.empty(numel, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    copy_bw = 2 * src.numel() * 4 / bench(lambda: dst.copy_(src), device, repeats)
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (1024, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    flops = 2 * n**3 / bench(lambda: a @ b, device, repeats)
    return copy_bw, flops


@dataclass
class Case:
    kernel: str
    shape: str
    work: float  # bytes moved, or FLOPs for compute-bound cases
    metric: str
    target: str
    impls: dict[str, Callable[[], object]]


def _norm_cases(device: torch.device, gpu: bool) -> list[Case]:
    t, h = (8192, 8192) if gpu else (512, 4096)
    x, r = torch.randn(t, h, device=device, dtype=DT), torch.randn(t, h, device=device, dtype=DT)
    w = torch.randn(h, device=device, dtype=DT)
    return [
        Case("rms_norm", f"T={t} H={h}", 2 * t * h * ESZ, "GB/s", ">=80% copy",
             {"torch": lambda: rms_norm_torch(x, w, 1e-6), "triton": lambda: rms_norm_triton(x, w, 1e-6)}),
        Case("fused_add_rms_norm", f"T={t} H={h}", 4 * t * h * ESZ, "GB/s", ">=80% copy",
             {"torch": lambda: fused_add_rms_norm_torch(x, r, w, 1e-6),
              "triton": lambda: fused_add_rms_norm_triton(x, r, w, 1e-6)}),
    ]


def _rope_case(device: torch.device, gpu: bool) -> list[Case]:
    t, hq, hk, d = (8192, 32, 8, 128) if gpu else (512, 32, 8, 128)
    q = torch.randn(t, hq, d, device=device, dtype=DT)
    k = torch.randn(t, hk, d, device=device, dtype=DT)
    pos = torch.randint(0, 8192, (t,), device=device)
    cos_sin = torch.randn(8192, d, device=device)
    work = 2 * t * (hq + hk) * d * ESZ + t * d * 4  # q, k read + written; one cos/sin row per token
    return [Case("rotary_embedding", f"T={t} Hq={hq} Hk={hk} D={d}", work, "GB/s", ">=80% copy",
                 {"torch": lambda: rotary_embedding_torch(pos, q, k, cos_sin),
                  "triton": lambda: rotary_embedding_triton(pos, q, k, cos_sin)})]


def _silu_case(device: torch.device, gpu: bool) -> list[Case]:
    t, inter = (8192, 14336) if gpu else (256, 14336)
    x = torch.randn(t, 2 * inter, device=device, dtype=DT)
    return [Case("silu_and_mul", f"T={t} I={inter}", 3 * t * inter * ESZ, "GB/s", ">=80% copy",
                 {"torch": lambda: silu_and_mul_torch(x), "triton": lambda: silu_and_mul_triton(x)})]


def _cache_write_case(device: torch.device, gpu: bool) -> list[Case]:
    t, hk, d, bs = (8192, 8, 128, 16) if gpu else (1024, 8, 128, 16)
    k, v = torch.randn(t, hk, d, device=device, dtype=DT), torch.randn(t, hk, d, device=device, dtype=DT)
    k_cache = torch.zeros(t // bs + 8, bs, hk, d, device=device, dtype=DT)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(k_cache.shape[0] * bs, device=device)[:t]
    return [Case("reshape_and_cache", f"T={t} Hk={hk} D={d}", 4 * t * hk * d * ESZ, "GB/s", ">=80% copy",
                 {"torch": lambda: reshape_and_cache_torch(k, v, k_cache, v_cache, slots),
                  "triton": lambda: reshape_and_cache_triton(k, v, k_cache, v_cache, slots)})]


def _decode_case(device: torch.device, gpu: bool, kv_dtype: torch.dtype) -> list[Case]:
    b, n, hq, hk, d, bs = (8, 32768, 32, 8, 128, 16) if gpu else (2, 4096, 32, 8, 128, 16)
    blocks = n // bs
    k_cache = torch.randn(b * blocks, bs, hk, d, device=device).to(kv_dtype)
    v_cache = torch.randn(b * blocks, bs, hk, d, device=device).to(kv_dtype)
    block_tables = torch.randperm(b * blocks, device=device).view(b, blocks).int()
    q = torch.randn(b, hq, d, device=device, dtype=DT)
    lens = torch.full((b,), n, dtype=torch.int32, device=device)
    sc = torch.tensor([0.05], device=device) if kv_dtype == torch.float8_e4m3fn else None
    args = (q, k_cache, v_cache, block_tables, lens, d**-0.5, sc, sc)
    name = "paged_decode_attention" + (" fp8" if sc is not None else "")
    return [Case(name, f"B={b} ctx={n} Hq={hq} Hk={hk} D={d}", 2 * b * n * hk * d * k_cache.element_size(),
                 "GB/s", ">=70% copy",
                 {"torch": lambda: paged_decode_attention_torch(*args),
                  "triton": lambda: paged_decode_attention_triton(*args, max_seq_len=n)})]


def _prefill_case(device: torch.device, gpu: bool) -> list[Case]:
    n, hq, hk, d = (8192, 32, 8, 128) if gpu else (1024, 32, 8, 128)
    q = torch.randn(n, hq, d, device=device, dtype=DT)
    k, v = torch.randn(n, hk, d, device=device, dtype=DT), torch.randn(n, hk, d, device=device, dtype=DT)
    empty_cache = torch.zeros(1, 16, hk, d, device=device, dtype=DT)
    meta = (torch.tensor([0, n], dtype=torch.int32, device=device), torch.zeros(1, dtype=torch.int32, device=device),
            torch.zeros(1, 1, dtype=torch.int32, device=device))  # query_start_loc, context_lens, block_tables
    args = (q, k, v, empty_cache, empty_cache, *meta, d**-0.5)
    qt, kt, vt = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # (H, N, D) for SDPA
    flops = 4 * hq * d * n * (n + 1) / 2  # QK^T and PV over the causal half
    return [Case("extend_attention (prefill)", f"N={n} Hq={hq} Hk={hk} D={d}", flops, "TFLOP/s", ">=0.9x sdpa",
                 {"torch": lambda: extend_attention_torch(*args),
                  "sdpa": lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True),
                  "triton": lambda: extend_attention_triton(*args)})]


def _pack_cases(device: torch.device, gpu: bool) -> list[Case]:
    layers, nblk, bs, hk, d = (32, 256, 16, 8, 128) if gpu else (8, 64, 16, 8, 128)
    cache = torch.randn(layers, 2, nblk * 2, bs, hk, d, device=device, dtype=DT)
    ids = torch.randperm(nblk * 2, device=device)[:nblk]
    cases = []
    for layout in ("LBHNC", "LBNHC"):
        buf = torch.empty(pack_shape(layout, layers, nblk, hk, bs, d), device=device, dtype=DT)
        cases.append(Case(f"kv_pack {layout}", f"L={layers} blocks={nblk} H={hk} N={bs} C={d}",
                          2 * buf.numel() * ESZ, "GB/s", ">=80% copy",
                          {"torch": functools.partial(pack_kv_blocks_torch, cache, ids, buf, layout),
                           "triton": functools.partial(pack_kv_blocks_triton, cache, ids, buf, layout)}))
    return cases


def _router_case(device: torch.device, gpu: bool) -> list[Case]:
    t, e, k = 64, 256, 8
    logits = torch.randn(t, e, device=device, dtype=DT)
    return [Case("moe_router", f"T={t} E={e} k={k}", t * e * ESZ + t * k * 8, "GB/s", "latency-bound",
                 {"torch": lambda: moe_router_torch(logits, k), "triton": lambda: moe_router_triton(logits, k)})]


def build_cases(device: torch.device, gpu: bool) -> list[Case]:
    # one function per kernel: each case's lambdas close over their own tensors
    return [
        *_norm_cases(device, gpu), *_rope_case(device, gpu), *_silu_case(device, gpu),
        *_cache_write_case(device, gpu), *_decode_case(device, gpu, DT),
        *_decode_case(device, gpu, torch.float8_e4m3fn), *_prefill_case(device, gpu),
        *_pack_cases(device, gpu), *_router_case(device, gpu),
    ]


def run(device: torch.device, repeats: int) -> tuple[dict[str, float], list[Row]]:
    gpu = device.type == "cuda"
    copy_bw, mm_flops = measure_peaks(device, repeats)
    rows = []
    for case in build_cases(device, gpu):
        for impl, fn in case.impls.items():
            if impl == "triton" and not gpu:
                continue
            if impl == "torch" and case.metric == "TFLOP/s" and gpu and "sdpa" in case.impls:
                continue  # the per-request einsum reference is not a baseline worth timing on GPU
            secs = bench(fn, device, repeats)
            if case.metric == "GB/s":
                achieved, frac = case.work / secs / 1e9, case.work / secs / copy_bw
            else:
                achieved, frac = case.work / secs / 1e12, case.work / secs / mm_flops
            rows.append(Row(case.kernel, case.shape, impl, secs * 1e6, case.metric, achieved, frac, case.target))
    peaks = {"copy_GBps": copy_bw / 1e9, "matmul_TFLOPs": mm_flops / 1e12}
    return peaks, rows


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


def print_table(device: torch.device, peaks: dict[str, float], rows: list[Row]) -> None:
    print(f"device: {_device_name(device)}   torch {torch.__version__}")
    print(f"measured peaks: copy {peaks['copy_GBps']:.1f} GB/s, matmul {peaks['matmul_TFLOPs']:.2f} TFLOP/s")
    header = f"{'kernel':<28} {'shape':<34} {'impl':<7} {'time us':>10} {'achieved':>16} {'of peak':>8}  target"
    print(header)
    print("-" * len(header))
    sdpa = {r.kernel: r.time_us for r in rows if r.impl == "sdpa"}
    for r in rows:
        extra = f"  ({sdpa[r.kernel] / r.time_us:.2f}x sdpa)" if r.impl == "triton" and r.kernel in sdpa else ""
        print(f"{r.kernel:<28} {r.shape:<34} {r.impl:<7} {r.time_us:>10.1f} {r.achieved:>8.2f} {r.metric:<7} "
              f"{r.of_peak:>7.1%}  {r.target}{extra}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per case on CPU (median)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    peaks, rows = run(device, args.repeats)
    if args.json:
        print(json.dumps({"device": _device_name(device), "peaks": peaks, "rows": [asdict(r) for r in rows]}, indent=2))
    else:
        print_table(device, peaks, rows)


if __name__ == "__main__":
    main()
