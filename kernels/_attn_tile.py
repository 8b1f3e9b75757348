"""Pieces shared by the paged decode and the extend attention kernels, and their torch references.

Online softmax (flash attention) in base 2: scores are pre-multiplied by log2(e) so exp2 (one
hardware instruction) replaces exp. Per query row the kernels carry

    m_i  running max of the scaled scores seen so far     (BLOCK_M,)
    l_i  running sum of exp2(score - m_i)                 (BLOCK_M,)
    acc  running sum of exp2(score - m_i) * v             (BLOCK_M, BLOCK_D), float32

and the attention output is acc / l_i once every key has been seen.

Paged addressing of key position `pos` of a request:

    block_table row:  [ b0 | b1 | b2 | ... ]          one entry per block_size positions
                               ^ pos // block_size
    address = block_id * stride_block + (pos % block_size) * stride_token + head * stride_head + d
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ._jit import is_interpreted, lazy_jit

if TYPE_CHECKING:
    import triton.language as tl

LOG2E = 1.4426950408889634


@lazy_jit
def paged_slots(block_table_row_ptr, pos, mask, BLOCK_SIZE: tl.constexpr):
    """(BLOCK_N,) key positions -> (block ids, offsets in block), both int64 for address math."""
    block_ids = tl.load(block_table_row_ptr + pos // BLOCK_SIZE, mask=mask, other=0).to(tl.int64)
    return block_ids, (pos % BLOCK_SIZE).to(tl.int64)


@lazy_jit
def online_softmax_step(q, k, v, m_i, l_i, acc, qk_scale, v_scale, mask, DOT_F32: tl.constexpr):
    """Fold one key tile into (m_i, l_i, acc).

    q (M, D), k (D, N), v (N, D), all in the dot dtype (the model dtype, or float32 when DOT_F32);
    mask (M, N) marks visible keys. qk_scale already includes softmax scale * log2(e) * k
    dequantisation scale; v_scale (the v dequantisation scale, 1.0 for float caches) is applied to
    the probabilities so tiles read from the cache and tiles of new, unquantised keys can share one
    accumulator.
    """
    if DOT_F32:  # exact float32 products; the default tf32 would drop 13 mantissa bits
        s = tl.dot(q, k, input_precision="ieee")
    else:
        s = tl.dot(q, k)
    s = tl.where(mask, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row with no visible key yet keeps m_i = -inf; shift by 0 instead so no -inf - -inf = NaN.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_shift)
    p = tl.exp2(s - m_shift[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    p = (p * v_scale).to(v.dtype)
    if DOT_F32:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p, v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


def dot_in_float32(dtype: torch.dtype, kernel: object) -> bool:
    """Whether the attention dots run on float32 operands: for float32 models (exactness), and for
    bfloat16 under Triton's CPU interpreter, whose tl.dot multiplies bfloat16 operands' raw bits."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and is_interpreted(kernel))


# ----------------------------------------------------------------------------------------------
# torch references


def gather_kv_torch(cache: torch.Tensor, block_table_row: torch.Tensor, length: int,
                    scale: torch.Tensor | float | None) -> torch.Tensor:
    """Positions [0, length) of one request from a paged cache -> (length, Hk, D) float32, dequantised."""
    block_size = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    blocks = block_table_row.long()[pos // block_size]
    kv = cache[blocks, pos % block_size].float()  # (length, Hk, D)
    if scale is not None:
        if isinstance(scale, torch.Tensor) and scale.numel() > 1:
            scale = scale.float().reshape(-1, 1)  # per KV head
        kv = kv * scale
    return kv


def causal_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                           context_len: int) -> torch.Tensor:
    """q: (Lq, Hq, D), k/v: (context_len + Lq, Hk, D), all float32 -> (Lq, Hq, D) float32.

    Query i sits at position context_len + i and sees keys [0, context_len + i]. GQA: query head h
    reads KV head h // (Hq // Hk).
    """
    num_q, num_heads = q.shape[0], q.shape[1]
    group = num_heads // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # (Hq, Lq, Lk)
    q_pos = context_len + torch.arange(num_q, device=q.device)
    k_pos = torch.arange(k.shape[0], device=q.device)
    scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
