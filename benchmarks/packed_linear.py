"""One linear layer's product, plain F.linear against the oneDNN pre-packed weight, by row count.

    python benchmarks/packed_linear.py                  # 768 x 3072 (the bench model's MLP), bf16 and fp32
    python benchmarks/packed_linear.py --k 2048 --n 8192 --rows 1 64 4096
    python benchmarks/packed_linear.py --hints 1 16 32 128   # also oneDNN packed for other batch hints

Why: whether packing pays depends on the CPU and on M (rows per call). On an AMX CPU (session 7)
the packed bf16 product won up to M = 256 and lost 22% at M = 2,048, so this table is the input to
any M-dependent pack decision (cpu_gemm: a bf16 copy serves up to its last exact probe rung). Prints
GFLOP/s, for the weight-bound small-M calls GB/s of weights, and which product the engine runs.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from pdcluster.models.layers.cpu_gemm import PACK_BATCH_HINT, pack_weight, packed_linear


def seconds_per_call(fn, calls: int, *fn_args) -> float:
    fn(*fn_args)
    fn(*fn_args)  # warm: oneDNN builds its primitive on the first call of a shape
    start = time.perf_counter()
    for _ in range(calls):
        fn(*fn_args)
    return (time.perf_counter() - start) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=768, help="in features")
    ap.add_argument("--n", type=int, default=3072, help="out features")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32, 256, 2048])
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--hints", type=int, nargs="*", default=[],
                    help="also time weights packed for these batch-size hints (cpu_gemm.PACK_BATCH_HINT picks one)")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"threads={torch.get_num_threads()} capability={torch.backends.cpu.get_cpu_capability()} K={args.k} N={args.n} "
          f"engine batch hint: {', '.join(f'{str(d)[6:]} {h}' for d, h in PACK_BATCH_HINT.items())}")
    print(f"{'dtype':>9} {'M':>6} {'plain GFLOP/s':>14} {'packed GFLOP/s':>15} {'packed/plain':>13} "
          f"{'packed weight GB/s':>19} {'engine runs':>12}" + "".join(f" {f'hint {h}':>8}" for h in args.hints))
    for dtype in (torch.bfloat16, torch.float32):
        w = torch.randn(args.n, args.k, dtype=dtype)
        packed = pack_weight(w)
        hinted = {h: torch.ops.mkldnn._reorder_linear_weight(w, h) for h in args.hints} if packed else {}
        for m in args.rows:
            x = torch.randn(m, args.k, dtype=dtype)
            flops = 2 * m * args.k * args.n
            plain_s = seconds_per_call(F.linear, args.calls, x, w)
            if packed is None:  # this torch/CPU cannot pack (or the probe refused): plain only
                print(f"{str(dtype)[6:]:>9} {m:>6} {flops / plain_s / 1e9:>14.0f} {'-':>15}")
                continue
            packed_s = seconds_per_call(packed_linear, args.calls, x, packed.blocked)
            print(f"{str(dtype)[6:]:>9} {m:>6} {flops / plain_s / 1e9:>14.0f} {flops / packed_s / 1e9:>15.0f} "
                  f"{plain_s / packed_s:>12.2f}x {w.numel() * w.element_size() / packed_s / 1e9:>19.1f} "
                  f"{'packed' if packed.serves(x) else 'plain':>12}"
                  + "".join(f" {flops / seconds_per_call(packed_linear, args.calls, x, p) / 1e9:>8.0f}"
                            for p in hinted.values()))


if __name__ == "__main__":
    main()
