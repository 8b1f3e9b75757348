"""KV cache write (`reshape_and_cache`): scatter new K and V rows into their cache slots.

Paged cache layout, per layer: k_cache / v_cache of shape (num_blocks, block_size, num_kv_heads,
head_dim). slot = block_id * block_size + offset; slot -1 means "do not write" (padding).

float8_e4m3fn caches store value / scale, saturated to +-448 (the largest finite e4m3 value; a
plain cast would turn out-of-range values into NaN). The scale is per tensor (a float, 0-d or
1-element tensor) or per KV head ((num_kv_heads,) tensor); dequantise by multiplying by it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ._checks import (
    FLOAT_DTYPES,
    FP8_DTYPE,
    FP8_E4M3_MAX,
    KV_DTYPES,
    as_scale,
    check_same,
    check_tensor,
    next_power_of_2,
)
from ._jit import lazy_jit

if TYPE_CHECKING:
    import triton.language as tl


def _quantize_torch(x: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    """x: (T, Hk, D) -> x / scale (per tensor or per head) in the cache dtype."""
    if isinstance(scale, torch.Tensor) and scale.numel() > 1:
        scale = scale.float().reshape(-1, 1)  # (Hk, 1): broadcasts over (T, Hk, D)
    xf = x.float() / scale
    if dtype == FP8_DTYPE:
        xf = xf.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return xf.to(dtype)


def write_index(slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(slots, rows): the int64 slots of the tokens that are written (slot >= 0) and their rows
    in k/v (None: every token). The same for every layer of a step, so a backend computes it once
    per step; with every slot valid (the usual step) no boolean indexing runs at all."""
    valid = slot_mapping >= 0
    if bool(valid.all()):
        return slot_mapping.long(), None
    rows = valid.nonzero().squeeze(1)
    return slot_mapping.index_select(0, rows).long(), rows


def reshape_and_cache_torch(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
    index: tuple[torch.Tensor, torch.Tensor | None] | None = None,
) -> None:
    """k, v: (T, Hk, D); slot_mapping: (T,) int64, negative = not written. With a float8 cache,
    values are divided by the scale before the cast (dequantise by multiplying by the same scale).
    index: write_index(slot_mapping), when the caller has it already (once per step)."""
    nb, bs, hk, d = k_cache.shape
    slots, rows = write_index(slot_mapping) if index is None else index
    kf, vf = (k, v) if rows is None else (k.index_select(0, rows), v.index_select(0, rows))
    if k_scale is not None or k_cache.dtype == FP8_DTYPE:
        kf = _quantize_torch(kf, 1.0 if k_scale is None else k_scale, k_cache.dtype)
        vf = _quantize_torch(vf, 1.0 if v_scale is None else v_scale, v_cache.dtype)
    # index_put_ (not index_copy_: no float8 kernel on CPU); as fast, with integer indices.
    k_cache.view(nb * bs, hk, d).index_put_((slots,), kf.to(k_cache.dtype))
    v_cache.view(nb * bs, hk, d).index_put_((slots,), vf.to(v_cache.dtype))


# ----------------------------------------------------------------------------------------------
# Triton
#
# One program per new token copies its (Hk, D) rows of K and of V into the slot:
#
#     slot = slot_mapping[t];  block = slot // block_size;  offset = slot % block_size
#     k_cache[block, offset, h, :] = quant(k[t, h, :])      for every KV head h, same for v
#
# The caches are addressed through their strides, so a per-layer view of the engine's one cache
# tensor (num_layers, 2, num_blocks, block_size, Hk, D) works without a copy.


@lazy_jit
def _round_to_e4m3(x):
    """Round float32 x (already within +-448) to the nearest-even float8_e4m3fn value, in float32.

    The GPU's cvt instruction already rounds this way, so on a GPU this changes nothing; it is
    here because Triton's CPU interpreter converts to float8 by truncating the mantissa without
    carry (7.875 -> 4.0), and the interpreter is what the CPU test suite runs. Exactly
    representable values convert exactly everywhere.
    """
    bits = x.to(tl.int32, bitcast=True)
    # keep 3 of float32's 23 mantissa bits, round half to even; a carry bumps the exponent
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # -1048576 == 0xFFF00000
    normal = bits.to(tl.float32, bitcast=True)
    # e4m3 subnormals (|x| < 2**-6) sit on a fixed 2**-9 grid: float32 addition of 1.5 * 2**14
    # (whose ulp is 2**-9) rounds to that grid, half to even.
    subnormal = (x + 24576.0) - 24576.0
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@lazy_jit
def _write_rows(src_ptr, stride_sh, dst_ptr, stride_dh, scale_ptr, scale_stride, num_heads,
                head_dim, QUANT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    d = tl.arange(0, BLOCK_D)
    for h0 in range(0, num_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        mask = (heads < num_heads)[:, None] & (d < head_dim)[None, :]
        x = tl.load(src_ptr + heads[:, None] * stride_sh + d[None, :], mask=mask, other=0.0)
        if QUANT:
            scale = tl.load(scale_ptr + heads * scale_stride, mask=heads < num_heads, other=1.0)
            xf = x.to(tl.float32) / scale[:, None]
            x = _round_to_e4m3(tl.minimum(tl.maximum(xf, -448.0), 448.0))  # FP8_E4M3_MAX: saturate, never NaN
        tl.store(dst_ptr + heads[:, None] * stride_dh + d[None, :], x.to(dst_ptr.dtype.element_ty), mask=mask)


@lazy_jit
def _reshape_and_cache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kco, stride_kch, stride_vcb, stride_vco, stride_vch,
    scale_stride, num_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, QUANT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token: nothing to write
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    _write_rows(k_ptr + t * stride_kt, stride_kh, k_cache_ptr + block * stride_kcb + offset * stride_kco,
                stride_kch, k_scale_ptr, scale_stride, num_heads, head_dim, QUANT, BLOCK_H, BLOCK_D)
    _write_rows(v_ptr + t * stride_vt, stride_vh, v_cache_ptr + block * stride_vcb + offset * stride_vco,
                stride_vch, v_scale_ptr, scale_stride, num_heads, head_dim, QUANT, BLOCK_H, BLOCK_D)


def reshape_and_cache_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
) -> None:
    """Same contract as reshape_and_cache_torch. k and v may be strided views (slices of a fused
    qkv output). A float8 cache without scales uses scale 1."""
    check_tensor("k_cache", k_cache, ndim=4, dtypes=KV_DTYPES)
    _, block_size, num_heads, head_dim = k_cache.shape
    dev = k_cache.device
    check_tensor("v_cache", v_cache, shape=tuple(k_cache.shape), dtypes=(k_cache.dtype,), device=dev)
    check_tensor("k", k, ndim=3, dtypes=FLOAT_DTYPES, device=dev)
    num_tokens = k.shape[0]
    check_tensor("k", k, shape=(num_tokens, num_heads, head_dim))
    check_tensor("v", v, shape=(num_tokens, num_heads, head_dim), dtypes=(k.dtype,), device=dev)
    check_tensor("slot_mapping", slot_mapping, shape=(num_tokens,), dtypes=(torch.int64, torch.int32),
                 device=dev, last_dim_contiguous=False)
    quant = k_cache.dtype == FP8_DTYPE
    if not quant and (k_scale is not None or v_scale is not None):
        raise ValueError(f"k_scale/v_scale are only used with a float8 cache, got k_cache.dtype {k_cache.dtype}")
    ks, scale_stride = as_scale("k_scale", 1.0 if k_scale is None else k_scale, num_heads, dev) if quant else (None, 0)
    vs, v_stride = as_scale("v_scale", 1.0 if v_scale is None else v_scale, num_heads, dev) if quant else (None, 0)
    check_same("k_scale, v_scale granularity (per tensor / per head)", scale_stride, v_stride)
    if num_tokens == 0:
        return
    block_d = next_power_of_2(head_dim)
    block_h = max(1, min(next_power_of_2(num_heads), 4096 // block_d))
    slots = slot_mapping.contiguous()
    ks = ks if ks is not None else slots  # any valid pointer: the kernel never reads it unquantised
    vs = vs if vs is not None else slots
    _reshape_and_cache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slots, ks, vs,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        scale_stride, num_heads, head_dim,
        BLOCK_SIZE=block_size, QUANT=quant, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4,
    )
