"""CPU decode attention over the paged cache, per layer: the two products of cpu_decode.decode.

    python benchmarks/cpu_decode_attention.py                       # bench model heads, fp32 and bf16
    python benchmarks/cpu_decode_attention.py --rows 8 32 --seq 128 512 1024 --dtypes float32

Why: decode() spreads q into a block-diagonal matrix and multiplies the gathered (b, S, Hk * D)
rows in place when Hk <= BLOCK_DIAG_MAX_KV_HEADS (Hk x the FLOPs, two fewer passes over the
context), else copies K/V head-major. Which one wins depends on the CPU and the dtype: the cutoff
was measured on an AVX512-BF16 EPYC in bf16. This prints ms per layer for both, the block gather
alone (the floor both share), and what the engine runs (the current cutoff).

The `native` column is the C kernel (kernels/csrc/paged_decode_cpu.c) that reads the blocks in
place, the engine's decode attention wherever it builds; `floor` is the time to read K and V once
at this machine's measured copy bandwidth (a 256 MiB copy between touched buffers: read + write).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from pdcluster.kernels import paged_decode_cpu
from pdcluster.models.layers import cpu_decode
from pdcluster.models.layers.cpu_decode import DecodePlan


def plan(rows: int, seq: int, block_size: int, num_blocks: int, gen: torch.Generator) -> DecodePlan:
    nb = -(-seq // block_size)
    tables = torch.randperm(num_blocks, generator=gen)[: rows * nb].view(rows, nb).to(torch.int32)
    seq_lens = torch.full((rows,), seq, dtype=torch.int64)
    return DecodePlan(None, tables, seq_lens, rows, seq, block_size, list(range(rows)), [seq] * rows)


def ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--seq", type=int, nargs="+", default=[128, 384, 768])
    ap.add_argument("--q-heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, cpu capability "
          f"{torch.backends.cpu.get_cpu_capability()}; Hq {args.q_heads}, Hk {args.kv_heads}, D {args.head_dim}; "
          f"engine cutoff BLOCK_DIAG_MAX_KV_HEADS = {cpu_decode.BLOCK_DIAG_MAX_KV_HEADS}")
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.1f} GB/s (read + write); native kernel built: {paged_decode_cpu.available()}")
    print("| dtype | rows | seq | gather ms | block-diagonal ms | head-major ms | native ms | floor ms | "
          "torch / native |")
    print("|---|---|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for name in args.dtypes:
        for rows in args.rows:
            for seq in args.seq:
                print(case(getattr(torch, name), rows, seq, args, gen, bw))


def copy_bandwidth() -> float:
    """Bytes per second of a 256 MiB copy into a buffer already touched (no page faults), counting
    both the read and the write (median of 5)."""
    x = torch.ones(64 << 20, dtype=torch.float32)
    y = torch.zeros_like(x)
    t = ms(lambda: y.copy_(x), 5)
    return 2 * x.numel() * 4 / (t / 1e3)


def case(dtype: torch.dtype, rows: int, seq: int, args: argparse.Namespace, gen: torch.Generator,
         bw: float) -> str:
    """One table row: the gather alone, then decode() both ways, ms per layer."""
    bs, hk, d = args.block_size, args.kv_heads, args.head_dim
    num_blocks = rows * -(-seq // bs) + 8
    k_cache = torch.randn(num_blocks, bs, hk, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, bs, hk, d, generator=gen).to(dtype)
    q = torch.randn(rows, args.q_heads, d, generator=gen).to(dtype)
    (g,) = plan(rows, seq, bs, num_blocks, gen).view(None)
    cutoff = cpu_decode.BLOCK_DIAG_MAX_KV_HEADS

    def gather() -> None:
        k_cache.view(num_blocks, -1).index_select(0, g.blocks)
        v_cache.view(num_blocks, -1).index_select(0, g.blocks)

    def run(limit: int) -> None:
        cpu_decode.BLOCK_DIAG_MAX_KV_HEADS = limit
        cpu_decode.decode(q, k_cache, v_cache, g, d ** -0.5)

    try:
        diag = ms(lambda: run(hk), args.reps)
        major = ms(lambda: run(0), args.reps)
    finally:
        cpu_decode.BLOCK_DIAG_MAX_KV_HEADS = cutoff
    torch_ms = diag if hk <= cutoff else major
    tables, lens = plan(rows, seq, bs, num_blocks, gen).tables, torch.full((rows,), seq, dtype=torch.int64)
    native = float("nan")
    if paged_decode_cpu.available():
        native = ms(lambda: paged_decode_cpu.paged_decode_attention_cpu(q, k_cache, v_cache, tables, lens,
                                                                        d ** -0.5), args.reps)
    floor = 1e3 * 2 * rows * seq * hk * d * k_cache.element_size() / bw
    name = str(dtype).removeprefix("torch.")
    return (f"| {name} | {rows} | {seq} | {ms(gather, args.reps):.3f} | {diag:.3f} | {major:.3f} | {native:.3f} | "
            f"{floor:.3f} | {torch_ms / native:.2f} |")

if __name__ == "__main__":
    main()
