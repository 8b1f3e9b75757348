"""Rotary position embedding applied to Q and K.

cos_sin_cache: (max_position, rotary_dim) float32, cos in the first rotary_dim/2 columns and sin in
the last (built by pdcluster/models/layers/rotary.py, which also applies rope scaling such as llama3).
Only the first rotary_dim channels of each head rotate (partial rotary); the rest pass through.
NeoX style rotates pairs (i, i + rotary_dim/2); GPT-J style rotates interleaved pairs (2i, 2i+1).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ._checks import FLOAT_DTYPES, INDEX_DTYPES, check_tensor, next_power_of_2
from ._jit import lazy_jit

if TYPE_CHECKING:
    import triton.language as tl


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    # x: (T, H, rot) float32; cos/sin: (T, 1, rot/2)
    if is_neox:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def rotary_embedding_torch(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: (T,) int; q: (T, Hq, D); k: (T, Hk, D). Rotates in place and returns (q, k)."""
    rot = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions.long()].unsqueeze(1).chunk(2, dim=-1)  # (T, 1, rot/2)
    for t in (q, k):
        if t.numel():  # k may be empty: q and k rotated as one tensor (RotaryEmbedding.rotate)
            part = t if rot == t.shape[-1] else t[..., :rot]
            part.copy_(_rotate(part.float(), cos, sin, is_neox))  # copy_ rounds to t.dtype
    return q, k


# ----------------------------------------------------------------------------------------------
# Triton
#
# One program per token rotates every head of q and then of k, in place. Channel pairs:
#
#     NeoX  (is_neox):  x1 = x[i],      x2 = x[i + rot/2]     i in [0, rot/2)
#     GPT-J:            x1 = x[2i],     x2 = x[2i + 1]
#     out1 = x1*cos[i] - x2*sin[i];  out2 = x2*cos[i] + x1*sin[i]     (float32, rounded once)
#
# Channels >= rot are never touched, which is all partial rotary needs.


@lazy_jit
def _rotate_heads(base_ptr, stride_h, num_heads, off1, off2, cos, sin, pair_mask, BLOCK_H: tl.constexpr):
    for h0 in range(0, num_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        mask = (heads < num_heads)[:, None] & pair_mask[None, :]
        ptrs = base_ptr + heads[:, None] * stride_h
        x1 = tl.load(ptrs + off1[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(ptrs + off2[None, :], mask=mask, other=0.0).to(tl.float32)
        out1 = x1 * cos[None, :] - x2 * sin[None, :]
        out2 = x2 * cos[None, :] + x1 * sin[None, :]
        tl.store(ptrs + off1[None, :], out1.to(base_ptr.dtype.element_ty), mask=mask)
        tl.store(ptrs + off2[None, :], out2.to(base_ptr.dtype.element_ty), mask=mask)


@lazy_jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cos_sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
    num_q_heads, num_k_heads,
    HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, IS_NEOX: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK_R)
    pair_mask = i < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + i, mask=pair_mask, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + i, mask=pair_mask, other=0.0)
    if IS_NEOX:
        off1 = i
        off2 = i + HALF
    else:
        off1 = 2 * i
        off2 = 2 * i + 1
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, num_q_heads, off1, off2, cos, sin, pair_mask, BLOCK_H)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, num_k_heads, off1, off2, cos, sin, pair_mask, BLOCK_H)


def rotary_embedding_triton(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as rotary_embedding_torch; q and k may be strided views (e.g. slices of a fused
    qkv output) as long as each head's channels are contiguous."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    num_tokens, num_q_heads, head_dim = q.shape
    check_tensor("k", k, shape=(num_tokens, None, head_dim), dtypes=(q.dtype,), device=q.device)
    check_tensor("positions", positions, shape=(num_tokens,), dtypes=INDEX_DTYPES, device=q.device,
                 last_dim_contiguous=False)
    check_tensor("cos_sin_cache", cos_sin_cache, ndim=2, dtypes=(torch.float32,), device=q.device)
    rot = cos_sin_cache.shape[1]
    if rot % 2 or not 0 < rot <= head_dim:
        raise ValueError(f"cos_sin_cache: rotary_dim {rot} must be even and in (0, head_dim={head_dim}]")
    for name, t in (("q", q), ("k", k)):
        if t.shape[1] > 1 and t.stride(1) < head_dim:  # heads would overlap: rotating one corrupts another
            raise ValueError(f"{name}: head stride {t.stride(1)} < head_dim {head_dim}")
    if num_tokens == 0:
        return q, k
    positions = positions.contiguous()
    half = rot // 2
    block_r = next_power_of_2(half)
    block_h = max(1, min(next_power_of_2(max(num_q_heads, k.shape[1])), 4096 // block_r))
    _rotary_kernel[(num_tokens,)](
        positions, q, k, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        num_q_heads, k.shape[1],
        HALF=half, BLOCK_R=block_r, BLOCK_H=block_h, IS_NEOX=bool(is_neox), num_warps=4,
    )
    return q, k
