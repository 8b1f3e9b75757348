"""Paged attention in plain torch, laid out for the CPU kernels torch ships (used by the torch
backend on every device; written for the CPU, where it is the default).

Why this shape (measured on torch 2.13, AVX512 CPU; see /work/notes/perf.md):
  - SDPA on 3-D (H, T, D) inputs dispatches to the unfused math kernel (bmm + softmax + copies,
    float32 upcasts); on 4-D (B, H, T, D) it takes the fused flash kernel: 2-3x faster. So every
    call here is 4-D.
  - Consecutive fresh prefills (nothing cached before them) of the same length are contiguous in
    q/k/v and run as ONE causal SDPA over a (n, T, H, D) view: no copy, one call per layer.
  - For decode (one query token per request) the flash kernel in bfloat16 is slower than float32
    (about 3x), and the padded context gather through a 5-D block-table index is slow. Instead
    the plan built once per step holds a flat slot index (B*S,) and an additive float32 mask; each
    layer gathers K/V with one index_select (head-major) and runs two bmm calls with the GQA
    group as the query rows, in the cache dtype; mask and softmax in float32.

StepPlan is derived from one AttentionMetadata and reused by every layer of that step.

A sliding window w: a token at position p sees (p - w, p]. Nothing before a query's window is read
from the cache: prefill chunks over a prefix gather from their first query's window start, decode
gathers only each request's last w positions. So blocks that left every layer's window may be
freed and reused (kv_cache_manager.py) while the request's block table still names them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pdcluster.models.layers.attention_backend import AttentionMetadata


@dataclass
class DecodePlan:
    """The decode rows of a step: gather index and masks shared by every layer."""

    tokens: torch.Tensor | None  # (B,) token rows of q/out; None when every token is a decode
    tables: torch.Tensor  # (B, max_blocks) block tables of the decode rows
    seq_lens: torch.Tensor  # (B,) int64
    num_reqs: int
    max_seq_len: int
    block_size: int
    # window (None: full) -> (slots (B * S,) int64: key j of request b at b * S + j, additive mask (B, 1, S))
    views: dict[int | None, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def view(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys the new tokens read and their float32 mask (0 visible, -inf padding). Full:
        positions 0..max_seq_len-1. Window w (when some sequence is longer): each request's last
        w positions [seq_len - w, seq_len), so no earlier (possibly freed) block is read."""
        if window is not None and window >= self.max_seq_len:
            window = None  # the window hides nothing this step
        if window not in self.views:
            dev = self.tables.device
            if window is None:
                pos = torch.arange(self.max_seq_len, device=dev)[None, :].expand(self.num_reqs, -1)
            else:
                pos = (self.seq_lens - window).clamp(min=0)[:, None] + torch.arange(window, device=dev)[None, :]
            valid = pos < self.seq_lens[:, None]
            pos = torch.minimum(pos, (self.seq_lens - 1).clamp(min=0)[:, None])  # inside the request's blocks
            slots = self.tables.long().gather(1, pos // self.block_size) * self.block_size + pos % self.block_size
            mask = torch.zeros(valid.shape, dtype=torch.float32, device=dev).masked_fill_(~valid, float("-inf"))
            self.views[window] = (slots.reshape(-1), mask[:, None, :])
        return self.views[window]


@dataclass
class StepPlan:
    fresh_runs: list[tuple[int, int, int]]  # (first token, number of requests, query_len)
    prefills: list[tuple[int, int, int]]  # (request index, first token, context_len): over the cache
    decode: DecodePlan | None


def build_plan(meta: AttentionMetadata, block_size: int) -> StepPlan:
    starts = list(itertools.accumulate(meta.query_lens_cpu, initial=0))
    fresh_runs: list[tuple[int, int, int]] = []
    prefills: list[tuple[int, int, int]] = []
    decode_rows: list[int] = []
    for i, (n, c) in enumerate(zip(meta.query_lens_cpu, meta.context_lens_cpu)):
        if n == 1:
            decode_rows.append(i)
        elif c > 0:
            prefills.append((i, starts[i], c))
        elif fresh_runs and fresh_runs[-1][2] == n and fresh_runs[-1][0] + fresh_runs[-1][1] * n == starts[i]:
            first, count, _ = fresh_runs[-1]
            fresh_runs[-1] = (first, count + 1, n)
        else:
            fresh_runs.append((starts[i], 1, n))
    decode = None
    if decode_rows:
        dev = meta.block_tables.device
        all_decode = len(decode_rows) == meta.num_reqs
        rows = None if all_decode else torch.tensor(decode_rows, device=dev)
        tables = meta.block_tables if rows is None else meta.block_tables[rows]
        seq_lens = (meta.seq_lens if rows is None else meta.seq_lens[rows]).long()
        max_seq_len = max(meta.seq_lens_cpu[i] for i in decode_rows)
        tokens = None if all_decode else torch.tensor([starts[i] for i in decode_rows], device=dev)
        decode = DecodePlan(tokens, tables, seq_lens, len(decode_rows), max_seq_len, block_size)
    return StepPlan(fresh_runs, prefills, decode)


def _slots(table: torch.Tensor, lo: int, hi: int, block_size: int) -> torch.Tensor:
    """(max_blocks,) block table -> (hi - lo,) int64 cache slots of positions lo..hi-1."""
    pos = torch.arange(lo, hi, device=table.device)
    return table[pos // block_size].long() * block_size + pos % block_size


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              meta: AttentionMetadata, plan: StepPlan, scale: float, window: int | None) -> torch.Tensor:
    """q (T, Hq, D), k/v (T, Hk, D) already written into the cache -> (T, Hq, D)."""
    dec = plan.decode
    if dec is not None and dec.tokens is None:
        return _decode(q, k_cache, v_cache, dec, scale, window)
    out = torch.empty_like(q)
    for first, count, n in plan.fresh_runs:
        e = first + count * n
        out[first:e].view(count, n, *q.shape[1:]).copy_(_fresh(q[first:e], k[first:e], v[first:e], count, scale,
                                                              window).transpose(1, 2))
    for i, s, c in plan.prefills:
        e = s + meta.query_lens_cpu[i]
        out[s:e] = _over_cache(q[s:e], k_cache, v_cache, meta.block_tables[i:i + 1], c, scale, window)
    if dec is not None:
        out[dec.tokens] = _decode(q[dec.tokens], k_cache, v_cache, dec, scale, window)
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
    hk, d = k_cache.shape[2], k_cache.shape[3]
    # The first query (position context_len) sees nothing before context_len - window + 1.
    lo = 0 if window is None else max(0, context_len - window + 1)
    slots = _slots(table[0], lo, seq_len, k_cache.shape[1])
    kc = k_cache.view(-1, hk, d).index_select(0, slots).to(q.dtype)  # (S, Hk, D)
    vc = v_cache.view(-1, hk, d).index_select(0, slots).to(q.dtype)
    # Query j sits at position context_len + j and sees [0, context_len + j] (the last `window`).
    key_pos = torch.arange(lo, seq_len, device=q.device)
    query_pos = torch.arange(context_len, seq_len, device=q.device)
    mask = key_pos[None, :] <= query_pos[:, None]  # (n, S)
    if window is not None:
        mask &= key_pos[None, :] > query_pos[:, None] - window
    out = F.scaled_dot_product_attention(_heads_first(q, 1), _heads_first(kc, 1), _heads_first(vc, 1),
                                         attn_mask=mask, scale=scale, enable_gqa=True)  # (1, Hq, n, D)
    return out[0].transpose(0, 1)


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, dec: DecodePlan, scale: float,
            window: int | None) -> torch.Tensor:
    """One new token per request: q (B, Hq, D) -> (B, Hq, D).

    K/V are gathered head-major, (Hk * B, S, D) contiguous, so both products are plain bmm calls
    over Hk * B matrices with the GQA group (G = Hq / Hk) as the query rows: scores (Hk * B, G, S)
    = q @ K^T, float32 mask and softmax, P @ V. (bmm copies a strided K view per call in bf16: a
    head-major copy once is cheaper.) The products run in the cache dtype, like transformers'
    eager attention: a float32 copy of K costs more than the matmul."""
    slots, mask = dec.view(window)
    b, s = dec.num_reqs, mask.shape[-1]
    hq, d = q.shape[1], q.shape[2]
    hk = k_cache.shape[2]
    group = hq // hk

    def gather(cache: torch.Tensor) -> torch.Tensor:
        rows = cache.view(-1, hk, d).index_select(0, slots).view(b, s, hk, d)
        return rows.permute(2, 0, 1, 3).reshape(hk * b, s, d)

    kc, vc = gather(k_cache), gather(v_cache)
    qs = q.to(kc.dtype).view(b, hk, group, d).transpose(0, 1).reshape(hk * b, group, d)
    scores = torch.bmm(qs, kc.transpose(1, 2)).float().mul_(scale).view(hk, b, group, s)
    probs = scores.add_(mask).softmax(dim=-1).to(vc.dtype)  # mask (B, 1, S) broadcasts
    out = torch.bmm(probs.view(hk * b, group, s), vc)  # (Hk * B, G, D)
    return out.view(hk, b, group, d).permute(1, 0, 2, 3).reshape(b, hq, d).to(q.dtype)


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
