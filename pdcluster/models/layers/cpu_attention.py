"""Paged attention in plain torch, laid out for the CPU kernels torch ships (used by the torch
backend on every device; written for the CPU, where it is the default).

Why this shape (measured on torch 2.13, AVX512 CPU; see /work/notes/perf.md):
  - SDPA on 3-D (H, T, D) inputs dispatches to the unfused math kernel (bmm + softmax + copies,
    float32 upcasts); on 4-D (B, H, T, D) it takes the fused flash kernel: 2-3x faster. So every
    call here is 4-D.
  - Consecutive fresh prefills (nothing cached before them) of the same length are contiguous in
    q/k/v and run as ONE causal SDPA over a (n, T, H, D) view: no copy, one call per layer.
  - Prefill chunks over a cached prefix gather their context by whole blocks (one index_select on
    the (num_blocks, block_size * Hk * D) view) and run one masked 4-D SDPA.
  - Decode rows (one query token per request) go to cpu_decode.py: grouped by context length so
    the padding stays small, gathered by blocks, two bmm with mask and softmax in float32.
  - But first, where the C kernel builds (kernels/prefill_attn_cpu.py), every prompt chunk of the
    step, fresh or over a prefix, goes to it in ONE call that reads K/V from the cache in place:
    torch's CPU flash SDPA ran at 29-35 GFLOP/s on one core where its bf16 GEMMs run ~200, a
    quarter of a 512-token prefill. The two SDPA paths above stay as the fallback (no compiler,
    an fp8 cache's float32 copy when q is bf16, head_dim not a multiple of 16, ...).

StepPlan is derived from one AttentionMetadata and reused by every layer of that step.

A sliding window w: a token at position p sees (p - w, p]. Nothing before a query's window is read
from the cache: prefill chunks over a prefix gather from the block of their first query's window
start, decode from the block of each request's position seq_len - w. So blocks that left every
layer's window may be freed and reused (kv_cache_manager.py) while the request's block table still
names them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdcluster.kernels import prefill_attn_cpu
from pdcluster.models.layers import cpu_decode
from pdcluster.models.layers.attention_backend import AttentionMetadata
from pdcluster.models.layers.cpu_decode import DecodePlan


@dataclass
class StepPlan:
    fresh_runs: list[tuple[int, int, int]]  # (first token, number of requests, query_len)
    prefills: list[tuple[int, int, int]]  # (request index, first token, context_len): over the cache
    decode: DecodePlan | None
    # Every non-decode request for the C kernel, checked once for every layer; None when the step
    # has none (or runs on another device).
    chunks: prefill_attn_cpu.Chunks | None = None


def build_plan(meta: AttentionMetadata, block_size: int) -> StepPlan:
    starts = list(itertools.accumulate(meta.query_lens_cpu, initial=0))
    fresh_runs: list[tuple[int, int, int]] = []
    prefills: list[tuple[int, int, int]] = []
    decode_rows: list[int] = []
    prefill_rows: list[int] = []
    for i, (n, c) in enumerate(zip(meta.query_lens_cpu, meta.context_lens_cpu)):
        if n == 1:
            decode_rows.append(i)
            continue
        prefill_rows.append(i)
        if c > 0:
            prefills.append((i, starts[i], c))
        elif fresh_runs and fresh_runs[-1][2] == n and fresh_runs[-1][0] + fresh_runs[-1][1] * n == starts[i]:
            first, count, _ = fresh_runs[-1]
            fresh_runs[-1] = (first, count + 1, n)
        else:
            fresh_runs.append((starts[i], 1, n))
    chunks = None
    if prefill_rows and meta.block_tables.device.type == "cpu":  # the C kernel runs on the CPU only
        chunks = prefill_attn_cpu.Chunks.build(
            meta.block_tables.index_select(0, torch.tensor(prefill_rows)).to(torch.int32),
            torch.tensor([[starts[i], meta.query_lens_cpu[i], meta.context_lens_cpu[i]] for i in prefill_rows]),
            meta.num_tokens, block_size)
    decode = None
    if decode_rows:
        dev = meta.block_tables.device
        all_decode = len(decode_rows) == meta.num_reqs
        rows = None if all_decode else torch.tensor(decode_rows, device=dev)
        tables = meta.block_tables if rows is None else meta.block_tables[rows]
        seq_lens = (meta.seq_lens if rows is None else meta.seq_lens[rows]).long()
        max_seq_len = max(meta.seq_lens_cpu[i] for i in decode_rows)
        tokens_cpu = [starts[i] for i in decode_rows]
        tokens = None if all_decode else torch.tensor(tokens_cpu, device=dev)
        decode = DecodePlan(tokens, tables, seq_lens, len(decode_rows), max_seq_len, block_size, tokens_cpu,
                            [meta.seq_lens_cpu[i] for i in decode_rows])
    return StepPlan(fresh_runs, prefills, decode, chunks)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              meta: AttentionMetadata, plan: StepPlan, scale: float, window: int | None) -> torch.Tensor:
    """q (T, Hq, D), k/v (T, Hk, D) already written into the cache -> (T, Hq, D)."""
    dec = plan.decode
    if dec is not None and dec.tokens is None:
        return cpu_decode.attend(q, None, k_cache, v_cache, dec, scale, window)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if plan.chunks is not None and prefill_attn_cpu.prefill_attention_cpu(
            q, k_cache, v_cache, plan.chunks, scale, window, out=out) is not None:
        if dec is not None:
            cpu_decode.attend(q, out, k_cache, v_cache, dec, scale, window)
        return out
    for first, count, n in plan.fresh_runs:
        e = first + count * n
        out[first:e].view(count, n, *q.shape[1:]).copy_(_fresh(q[first:e], k[first:e], v[first:e], count, scale,
                                                              window).transpose(1, 2))
    for i, s, c in plan.prefills:
        e = s + meta.query_lens_cpu[i]
        out[s:e] = _over_cache(q[s:e], k_cache, v_cache, meta.block_tables[i:i + 1], c, scale, window)
    if dec is not None:
        cpu_decode.attend(q, out, k_cache, v_cache, dec, scale, window)
    return out


def _heads_first(x: torch.Tensor, count: int) -> torch.Tensor:
    """(count * n, H, D) -> (count, H, n, D) view."""
    return x.view(count, -1, *x.shape[1:]).transpose(1, 2)


def _fresh(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: int, scale: float,
           window: int | None) -> torch.Tensor:
    """`count` fresh prefills of n tokens each, back to back -> (count, Hq, n, D)."""
    n = q.shape[0] // count
    qh, kh, vh = _heads_first(q, count), _heads_first(k, count), _heads_first(v, count)
    if window is None or window >= n:  # top-left causal, no mask tensor
        return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    pos = torch.arange(n, device=q.device)
    mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)  # (n, n)
    return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)


def _over_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                context_len: int, scale: float, window: int | None) -> torch.Tensor:
    """One chunk after context_len cached tokens: q (n, Hq, D) -> (n, Hq, D) over the cache."""
    n = q.shape[0]
    seq_len = context_len + n
    nblk, bs, hk, d = k_cache.shape
    # The first query (position context_len) sees nothing before context_len - window + 1: read
    # whole blocks from the one holding that position (blocks wholly behind it may be freed).
    first = (0 if window is None else max(0, context_len - window + 1)) // bs
    blocks = table[0, first:(seq_len - 1) // bs + 1].long()
    kc = k_cache.view(nblk, -1).index_select(0, blocks).view(-1, hk, d).to(q.dtype)  # (S, Hk, D)
    vc = v_cache.view(nblk, -1).index_select(0, blocks).view(-1, hk, d).to(q.dtype)
    # Query j sits at position context_len + j and sees [0, context_len + j] (the last `window`);
    # keys past seq_len - 1 (the rest of the last block) are behind every query's causal edge.
    key_pos = torch.arange(first * bs, first * bs + kc.shape[0], device=q.device)
    query_pos = torch.arange(context_len, seq_len, device=q.device)
    mask = key_pos[None, :] <= query_pos[:, None]  # (n, S)
    if window is not None:
        mask &= key_pos[None, :] > query_pos[:, None] - window
    out = F.scaled_dot_product_attention(_heads_first(q, 1), _heads_first(kc, 1), _heads_first(vc, 1),
                                         attn_mask=mask, scale=scale, enable_gqa=True)  # (1, Hq, n, D)
    return out[0].transpose(0, 1)


class PlanCache:
    """The plan of the current step, built by the first layer and reused by the others (the
    runner builds one AttentionMetadata per step, so its identity names the step)."""

    def __init__(self) -> None:
        self._meta: AttentionMetadata | None = None
        self._plan: StepPlan | None = None

    def get(self, meta: AttentionMetadata, block_size: int) -> StepPlan:
        if self._meta is not meta or self._plan is None:
            self._meta, self._plan = meta, build_plan(meta, block_size)
        return self._plan
