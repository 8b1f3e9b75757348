"""Decode attention (one new token per request) over the paged cache, in plain torch for the CPU.

Decode attention on a CPU is memory-bound: every step reads each request's whole K/V context once
per layer. Where the machine has a C compiler, `attend` runs the C kernel of
kernels/paged_decode_cpu.py, which reads every block in place exactly once (K, then V) with the
scores and softmax in float32: 1.1-7x faster than the torch path below in float32 and 5-50x in
bfloat16 on an AVX2 CPU without BF16 instructions (benchmarks/cpu_decode_attention.py). The torch
path stays for the caches the kernel does not take (float8, float16) and machines without a
compiler (PDCLUSTER_NATIVE=0 forces it). What the torch path does (measured on a 2-vCPU AVX512-BF16 EPYC, torch 2.13, bf16,
125M Llama with 4 KV heads; /work/notes/attn.md):
  - Rows are grouped by how many cache blocks they read. One padded gather over every row cost
    B * max_seq_len slots per layer: a step with contexts of 20 and 700 tokens read 700 for each.
    The rows are sorted by block count and cut into groups by a small dynamic programme whose cost
    is the padded keys of a group plus a fixed per-group overhead (GROUP_OVERHEAD_KEYS: the ~12
    torch calls of one group), so rows of similar length share a call and the padding stays small.
  - K/V are gathered by whole blocks (index_select on the (num_blocks, block_size * Hk * D) view:
    rows of a block, not of a slot), straight from the block tables, no per-slot index.
  - With few KV heads (Hk <= BLOCK_DIAG_MAX_KV_HEADS) the products read the gathered (b, S, Hk * D)
    rows in place: q is spread into a block-diagonal (b, Hq, Hk * D) matrix (head h's queries in
    columns h * D..), so scores = q_bd @ K^T is (b, Hq, S) exactly (the zeros add exact zeros), and
    P @ V is (b, Hq, Hk * D) whose diagonal blocks are the output. That spends Hk x the FLOPs of
    the products but saves the head-major copy of K and V (two of the five passes over the
    context), and the GEMMs get S as a long dimension; measured 1.5-2x faster at B=32, S=320-768.
    With more KV heads the waste grows, so K/V are copied head-major (Hk * b, S, D) and multiplied
    with the GQA group as the query rows.
  - Scores, mask and softmax in float32; the products in the cache dtype (like transformers' eager
    attention: a float32 copy of K costs more than the matmul).

A sliding window w: a token at position p sees (p - w, p]. A row reads only the blocks from the one
holding position seq_len - w on, so blocks wholly behind its window (possibly freed and reused, see
kv_cache_manager.py) are never read; positions outside the window inside those blocks are masked.
Padding blocks repeat the row's last block (it is the row's own, so it holds finite values).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdcluster.kernels import paged_decode_cpu

# Fixed cost of one group per layer, in padded key positions of one row. A group costs about a dozen
# small torch calls (~0.1 ms here); one key position of one row ~0.3-0.5 us (gather + products).
GROUP_OVERHEAD_KEYS = 256
BLOCK_DIAG_MAX_KV_HEADS = 4
_DP_MAX_SIZES = 64  # distinct block counts the grouping considers exactly (more: rounded up first)


@dataclass
class DecodeGroup:
    """Decode rows that share one gather: their blocks, row-major, and the additive float32 mask."""

    rows: torch.Tensor | None  # (b,) token rows of q/out; None: every token of the step, in order
    blocks: torch.Tensor  # (b * nb,) int64: row i reads blocks[i * nb:(i + 1) * nb]
    mask: torch.Tensor  # (b, 1, nb * block_size) float32: 0 visible, -inf hidden
    num_rows: int
    num_blocks: int


@dataclass
class DecodePlan:
    """The decode rows of a step; groups per window value, built once per step, used by every layer."""

    tokens: torch.Tensor | None  # (B,) token rows of q/out; None when every token is a decode
    tables: torch.Tensor  # (B, max_blocks) block tables of the decode rows
    seq_lens: torch.Tensor  # (B,) int64
    num_reqs: int
    max_seq_len: int
    block_size: int
    tokens_cpu: list[int]  # token row of each decode row
    seq_lens_cpu: list[int]
    views: dict[int | None, list[DecodeGroup]] = field(default_factory=dict)

    def view(self, window: int | None) -> list[DecodeGroup]:
        """The groups of this step for a layer with `window` (None: full attention)."""
        if window is not None and window >= self.max_seq_len:
            window = None  # the window hides nothing this step
        if window not in self.views:
            self.views[window] = self._build(window)
        return self.views[window]

    def _build(self, window: int | None) -> list[DecodeGroup]:
        bs = self.block_size
        lo = [0 if window is None else max(0, s - window) for s in self.seq_lens_cpu]  # first visible key
        first = [p // bs for p in lo]
        count = [(s - 1) // bs - f + 1 for s, f in zip(self.seq_lens_cpu, first)]  # blocks each row reads
        groups = group_rows(count, GROUP_OVERHEAD_KEYS / bs)
        all_tokens = self.tokens is None
        dev = self.tables.device
        out = []
        for rows in groups:
            if len(groups) == 1:
                rows = list(range(self.num_reqs))  # one group: keep the step's order
            nb = max(count[i] for i in rows)
            idx = torch.tensor(rows, device=dev)
            f = torch.tensor([first[i] for i in rows], device=dev)
            n = torch.tensor([count[i] for i in rows], device=dev)
            col = f[:, None] + torch.minimum(torch.arange(nb, device=dev)[None, :], n[:, None] - 1)
            blocks = self.tables.index_select(0, idx).long().gather(1, col).reshape(-1)
            pos = f[:, None] * bs + torch.arange(nb * bs, device=dev)[None, :]
            visible = (pos >= torch.tensor([lo[i] for i in rows], device=dev)[:, None]) & (
                pos < self.seq_lens.index_select(0, idx)[:, None])
            mask = torch.zeros(visible.shape, dtype=torch.float32, device=dev).masked_fill_(~visible, float("-inf"))
            token_rows = None if all_tokens and len(groups) == 1 else torch.tensor(
                [self.tokens_cpu[i] for i in rows], device=dev)
            out.append(DecodeGroup(token_rows, blocks, mask[:, None, :], len(rows), nb))
        return out


def group_rows(count: list[int], overhead: float) -> list[list[int]]:
    """Rows (indices into `count`, blocks each row reads) cut into groups minimising
    sum over groups of (overhead + rows * max blocks): sorted by count, then an O(K^2) dynamic
    programme over the K distinct counts (rounded up to at most _DP_MAX_SIZES values)."""
    order = sorted(range(len(count)), key=count.__getitem__)
    step = -(-count[order[-1]] // _DP_MAX_SIZES) if len(set(count)) > _DP_MAX_SIZES else 1
    keyed = [-(-count[i] // step) * step for i in order]  # sorted, rounded up to a multiple of step
    sizes = sorted(set(keyed))
    ends = [0] * len(sizes)  # rows (in sorted order) with key <= sizes[k]
    j = 0
    for k, s in enumerate(sizes):
        while j < len(keyed) and keyed[j] <= s:
            j += 1
        ends[k] = j
    best = [0.0] * (len(sizes) + 1)  # best[k]: cost of the rows of the first k sizes
    cut = [0] * (len(sizes) + 1)
    for k in range(1, len(sizes) + 1):
        best[k] = float("inf")
        for i in range(k):  # the last group holds sizes i..k-1
            c = best[i] + overhead + (ends[k - 1] - (ends[i - 1] if i else 0)) * sizes[k - 1]
            if c < best[k]:
                best[k], cut[k] = c, i
    groups, k = [], len(sizes)
    while k:
        i = cut[k]
        groups.append(order[(ends[i - 1] if i else 0):ends[k - 1]])
        k = i
    return groups[::-1]


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: DecodeGroup,
           scale: float) -> torch.Tensor:
    """One group's new tokens q (b, Hq, D) -> (b, Hq, D), in q's dtype."""
    b, nb = g.num_rows, g.num_blocks
    nblk, bs, hk, d = k_cache.shape
    hq, s = q.shape[1], nb * bs
    group = hq // hk
    kc = k_cache.view(nblk, -1).index_select(0, g.blocks).view(b, s, hk, d)
    vc = v_cache.view(nblk, -1).index_select(0, g.blocks).view(b, s, hk, d)
    qc = q.to(kc.dtype)
    if hk <= BLOCK_DIAG_MAX_KV_HEADS:
        eye = torch.eye(hk, dtype=kc.dtype, device=q.device).view(1, hk, 1, hk, 1)
        q_bd = (qc.view(b, hk, group, 1, d) * eye).view(b, hq, hk * d)
        scores = torch.bmm(q_bd, kc.view(b, s, hk * d).transpose(1, 2)).float().mul_(scale)  # (b, Hq, S)
        probs = scores.add_(g.mask).softmax(dim=-1).to(vc.dtype)
        out = torch.bmm(probs, vc.view(b, s, hk * d)).view(b, hk, group, hk, d)
        return torch.diagonal(out, dim1=1, dim2=3).permute(0, 3, 1, 2).reshape(b, hq, d).to(q.dtype)
    # Head-major copies: bmm over Hk * b matrices with the GQA group as the query rows (bf16 bmm
    # copies strided per-head views itself, so one copy here is cheaper).
    kh = kc.permute(2, 0, 1, 3).reshape(hk * b, s, d)
    vh = vc.permute(2, 0, 1, 3).reshape(hk * b, s, d)
    qs = qc.view(b, hk, group, d).transpose(0, 1).reshape(hk * b, group, d)
    scores = torch.bmm(qs, kh.transpose(1, 2)).float().mul_(scale).view(hk, b, group, s)
    probs = scores.add_(g.mask).softmax(dim=-1).to(vh.dtype)  # mask (b, 1, S) broadcasts
    out = torch.bmm(probs.view(hk * b, group, s), vh)  # (Hk * b, G, D)
    return out.view(hk, b, group, d).permute(1, 0, 2, 3).reshape(b, hq, d).to(q.dtype)


def attend(q: torch.Tensor, out: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor,
           dec: DecodePlan, scale: float, window: int | None) -> torch.Tensor:
    """Every decode row of the step: written into `out` (rows dec.tokens), or returned when every
    token of the step is a decode (out None)."""
    if paged_decode_cpu.supports(k_cache, v_cache):
        rows = q if dec.tokens is None else q.index_select(0, dec.tokens)
        res = paged_decode_cpu.paged_decode_attention_cpu(rows, k_cache, v_cache, dec.tables, dec.seq_lens, scale,
                                                          window)
        if res is not None:
            if out is None:
                return res
            return out.index_copy_(0, dec.tokens, res)
    groups = dec.view(window)
    if out is None and len(groups) == 1:
        return decode(q, k_cache, v_cache, groups[0], scale)
    if out is None:
        out = torch.empty_like(q)
    for g in groups:
        assert g.rows is not None
        out.index_copy_(0, g.rows, decode(q.index_select(0, g.rows), k_cache, v_cache, g, scale))
    return out
