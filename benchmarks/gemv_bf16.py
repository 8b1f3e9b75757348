"""Decode-sized linear products: oneDNN's packed GEMV (models/layers/cpu_gemm.py) against the C
kernels over bfloat16 weights (models/layers/cpu_gemv.py): float32 rows on the tiles of
kernels/csrc/gemv_bf16_cpu.c, or with --onednn-dtype bfloat16 bf16 rows, on the dot-product pairs
of kernels/csrc/gemv_bf16_dot_cpu.c where the CPU has AVX512-BF16 (the tiles elsewhere), on
the 125M bench Llama's shapes, at several row counts M, weights cold (each rep multiplies another
copy, ~200 MB of them, so nothing is served from the caches).

    python benchmarks/gemv_bf16.py                 # M = 1 2 4 8 16 32, 2 threads
    python benchmarks/gemv_bf16.py --rows 1 4 --threads 1
    python benchmarks/gemv_bf16.py --onednn-dtype bfloat16   # a CPU with bf16 dot products: oneDNN in bf16

Per shape: ms per product (median of --rounds rounds of --reps products), float32 GB/s for oneDNN
(the bytes it reads), bfloat16 GB/s for the kernel, the ratio. Last: one decode step's 49 products
(12 layers x qkv, o, gate_up, down + the LM head) summed.
"""

from __future__ import annotations

import argparse
import statistics
import time

SHAPES = [("qkv", 1280, 768, 12), ("o", 768, 768, 12), ("gate_up", 4096, 768, 12), ("down", 768, 2048, 12),
          ("lm_head", 32000, 768, 1)]


def _timed(fn, copies: int, reps: int, rounds: int) -> float:
    """Median over `rounds` of the mean ms of `reps` calls fn(i), i cycling over the copies."""
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for i in range(reps):
            fn(i % copies)
        times.append((time.perf_counter() - t0) / reps * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cold-mb", type=int, default=200)
    parser.add_argument("--onednn-dtype", choices=["float32", "bfloat16"], default="float32",
                        help="oneDNN's side: float32 (what a CPU without BF16 computes in) or bfloat16 (what "
                             "a CPU with bf16 dot products computes in: AVX512-BF16, AMX)")
    args = parser.parse_args()
    import torch

    from pdcluster.kernels import gemv_bf16_cpu
    from pdcluster.models.layers import cpu_gemm

    torch.set_num_threads(args.threads)
    if not gemv_bf16_cpu.available():
        raise SystemExit("the C kernel is unavailable (no compiler, or PDCLUSTER_NATIVE=0)")
    dtype = getattr(torch, args.onednn_dtype)
    tag = "fp32" if dtype == torch.float32 else "bf16"
    flags = open("/proc/cpuinfo").read()
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in flags]
    # float32 rows take the tiles; bf16 rows the layout a bf16 model's copies get here
    layout = None if dtype == torch.bfloat16 else gemv_bf16_cpu.TILES
    print(f"threads={args.threads} cpu_isa={','.join(isa)} torch={torch.__version__} "
          f"kernel_layout={layout or gemv_bf16_cpu.default_layout()}")
    weights = {}
    for name, n, k, _ in SHAPES:
        copies = max(2, int(args.cold_mb * 1e6 / (n * k * dtype.itemsize)))
        plain = [(torch.randn(n, k) * 0.02).to(dtype) for _ in range(copies)]
        weights[name] = ([cpu_gemm.pack_weight(w).blocked for w in plain], [gemv_bf16_cpu.pack(w.bfloat16(), layout) for w in plain])
        del plain
    for m in args.rows:
        step = {"onednn": 0.0, "bf16": 0.0}
        for name, n, k, per_step in SHAPES:
            packed, bf16 = weights[name]
            x = torch.randn(m, k)
            reps = max(5, int(2e8 / (n * k * 4)))

            a = _timed(lambda i, x=x.to(dtype), w=packed: cpu_gemm.packed_linear(x, w[i]), len(packed), reps, args.rounds)
            # bf16 compute: x holds bfloat16 values, and the kernel takes bf16 dot products where it can
            xk, bf16_x = (x.bfloat16().float(), True) if dtype == torch.bfloat16 else (x, False)
            c = _timed(lambda i, x=xk, w=bf16, b=bf16_x: gemv_bf16_cpu.gemv_bf16(x, w[i], bf16_x=b), len(bf16), reps,
                       args.rounds)
            step["onednn"] += a * per_step
            step["bf16"] += c * per_step
            print(f"M={m:3d} {name:8s} {n:5d}x{k:<5d} oneDNN {tag} {a:7.3f} ms "
                  f"({n * k * dtype.itemsize / a / 1e6:5.1f} GB/s)  "
                  f"bf16 kernel {c:7.3f} ms ({n * k * 2 / c / 1e6:5.1f} GB/s)  {a / c:5.2f}x")
        print(f"M={m:3d} one decode step's products: oneDNN {tag} {step['onednn']:.2f} ms, bf16 kernel "
              f"{step['bf16']:.2f} ms -> {step['onednn'] / step['bf16']:.2f}x")


if __name__ == "__main__":
    main()
