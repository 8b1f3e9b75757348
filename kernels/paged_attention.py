"""Paged decode attention: one new query token per request against its whole paged KV context.

    q            (B, Hq, D)                       the decode token of each request
    k/v_cache    (num_blocks, block_size, Hk, D)  float32 / bfloat16 / float16 / float8_e4m3fn
    block_tables (B, max_blocks) int32            block_tables[b, p // block_size] holds position p
    seq_lens     (B,) int32                       keys of request b: positions [0, seq_lens[b])
    -> out       (B, Hq, D) in q's dtype, softmax and accumulation in float32

sliding_window w (optional): only the last w keys, positions [seq_len - w, seq_len), are read;
the splits then tile those w keys, not the whole context.

GQA with any ratio G = Hq / Hk: one program serves the G query heads that share a KV head, so each
key and value is read once per KV head, not once per query head. float8 caches are dequantised
with k_scale / v_scale, per tensor or per KV head.

Split-KV (flash-decoding): with few requests a grid of B * Hk programs leaves most SMs idle, so
the context is cut into `num_splits` chunks processed in parallel and merged by a second kernel:

    positions  0 ........................................... max_seq_len
    split      |  s=0  tokens_per_split |  s=1  |  s=2  | ...
    each split writes (acc / l_i, lse = m_i + log2 l_i) per head; the reduction weights split s by
    2**(lse_s - max lse) and renormalises. Splits past a request's seq_len write lse = -inf.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from ._attn_tile import (
    LOG2E,
    causal_attention_torch,
    dot_in_float32,
    gather_kv_torch,
    online_softmax_step,
    paged_slots,
)
from ._checks import FLOAT_DTYPES, KV_DTYPES, cdiv, check_tensor, kv_scales, next_power_of_2
from ._jit import lazy_jit

if TYPE_CHECKING:
    import triton.language as tl

_BLOCK_N = 64  # keys per tile: 64 rows of a 128-dim bf16 head = 16 KiB in flight per tile
_MIN_TOKENS_PER_SPLIT = 256  # shorter splits cost more in the reduction than they win
_NO_WINDOW = 2**30  # "window" of a full-context call: seq_len - it is below 0


def paged_decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Reference: gathers each request's keys and values and attends in float32."""
    out = torch.zeros_like(q)
    for b, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        lo = max(0, n - sliding_window) if sliding_window else 0
        k = gather_kv_torch(k_cache, block_tables[b], n, k_scale)[lo:]
        v = gather_kv_torch(v_cache, block_tables[b], n, v_scale)[lo:]
        out[b] = causal_attention_torch(q[b : b + 1].float(), k, v, scale, n - 1 - lo)[0].to(q.dtype)
    return out


# ----------------------------------------------------------------------------------------------
# Triton


@lazy_jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, k_scale_ptr, v_scale_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    qk_scale, scale_stride, tokens_per_split, window,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bt, stride_ob, stride_oh,
    G: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    HAS_SCALE: tl.constexpr, DOT_F32: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    # Splits tile the visible keys [seq_len - window, seq_len) (the whole context without a window).
    start = tl.maximum(seq_len - window, 0) + split * tokens_per_split
    end = tl.minimum(seq_len, start + tokens_per_split)

    g = tl.arange(0, BLOCK_G)  # query heads of this KV head, padded to >= 16 rows for tl.dot
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * G + g
    d_mask = d < HEAD_DIM
    q_mask = (g < G)[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=q_mask,
                other=0.0)  # (BLOCK_G, BLOCK_D)
    if DOT_F32:
        q = q.to(tl.float32)  # k and v follow q's dtype below
    v_scale = 1.0
    if HAS_SCALE:
        qk_scale *= tl.load(k_scale_ptr + kv_head * scale_stride)
        v_scale = tl.load(v_scale_ptr + kv_head * scale_stride)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        n_mask = pos < end
        blk, off = paged_slots(bt_row, pos, n_mask, BLOCK_SIZE)
        k_rows = blk * stride_kb + off * stride_kt + kv_head * stride_kh
        v_rows = blk * stride_vb + off * stride_vt + kv_head * stride_vh
        k = tl.load(k_cache_ptr + k_rows[None, :] + d[:, None], mask=d_mask[:, None] & n_mask[None, :],
                    other=0.0)  # (BLOCK_D, BLOCK_N): K transposed, ready for q @ k
        v = tl.load(v_cache_ptr + v_rows[:, None] + d[None, :], mask=n_mask[:, None] & d_mask[None, :],
                    other=0.0)  # (BLOCK_N, BLOCK_D)
        m_i, l_i, acc = online_softmax_step(q, k.to(q.dtype), v.to(q.dtype), m_i, l_i, acc, qk_scale,
                                            v_scale, n_mask[None, :], DOT_F32)

    has_keys = l_i > 0.0  # false for empty splits and zero-length requests
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        # partials: part_out (B, Hq, NUM_SPLITS, HEAD_DIM), part_lse (B, Hq, NUM_SPLITS), float32
        row = (b * (tl.num_programs(1) * G) + heads).to(tl.int64) * NUM_SPLITS + split
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], out, mask=q_mask)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=g < G)


@lazy_jit
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    row = (b * tl.num_programs(1) + head).to(tl.int64) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + row + s, mask=s < NUM_SPLITS, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # no keys at all: output zeros
    w = tl.exp2(lse - lse_max)  # (BLOCK_S,), 0 for empty splits
    part = tl.load(part_out_ptr + (row + s[:, None]) * HEAD_DIM + d[None, :],
                   mask=(w > 0.0)[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    denom = tl.sum(w, axis=0)
    out = tl.sum(part * w[:, None], axis=0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the interpreter runs programs one after another: splitting only adds work


def _choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    # Aim for ~4 programs per SM so memory latency hides behind other programs' loads.
    want = cdiv(4 * _num_sms(device), max(1, batch * num_kv_heads))
    return max(1, min(want, max_seq_len // _MIN_TOKENS_PER_SPLIT, 128))


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Decode attention (see the module docstring for shapes). max_seq_len (an upper bound of
    seq_lens, e.g. AttentionMetadata.max_seq_len) sizes the split-KV grid without a device sync;
    num_splits overrides the automatic choice; out (B, Hq, D) receives the result if given;
    sliding_window (tokens, None = whole context) limits the keys to the last ones."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    batch, num_q_heads, head_dim = q.shape
    dev = q.device
    check_tensor("k_cache", k_cache, ndim=4, dtypes=KV_DTYPES, device=dev)
    num_kv_heads = k_cache.shape[2]
    check_tensor("k_cache", k_cache, shape=(None, None, num_kv_heads, head_dim))
    check_tensor("v_cache", v_cache, shape=tuple(k_cache.shape), dtypes=(k_cache.dtype,), device=dev)
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32, torch.int64), device=dev)
    check_tensor("block_tables", block_tables, shape=(batch, None))
    check_tensor("seq_lens", seq_lens, shape=(batch,), dtypes=(torch.int32, torch.int64), device=dev,
                 last_dim_contiguous=False)
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q: num_heads {num_q_heads} must be a multiple of k_cache's num_kv_heads {num_kv_heads}")
    ks, vs, scale_stride, has_scale = kv_scales(k_cache.dtype, k_scale, v_scale, num_kv_heads, dev)
    if out is None:
        out = torch.empty_like(q)
    check_tensor("out", out, shape=tuple(q.shape), dtypes=(q.dtype,), device=dev)
    if batch == 0:
        return out
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item())  # one device sync; pass max_seq_len to avoid it
    span = min(max_seq_len, sliding_window or max_seq_len)  # most keys any request reads
    if num_splits is None:
        num_splits = _choose_num_splits(batch, num_kv_heads, span, dev)
    tokens_per_split = cdiv(cdiv(max(span, 1), num_splits), _BLOCK_N) * _BLOCK_N
    num_splits = max(1, cdiv(span, tokens_per_split))  # drop splits that would all be empty

    group = num_q_heads // num_kv_heads
    block_d = next_power_of_2(head_dim)
    seq_lens = seq_lens.contiguous()
    if num_splits > 1:
        part_out = torch.empty((batch, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=dev)
        part_lse = torch.empty((batch, num_q_heads, num_splits), dtype=torch.float32, device=dev)
    else:
        part_out = part_lse = out  # unused: the kernel stores straight into out
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, ks if has_scale else seq_lens, vs if has_scale else seq_lens,
        out, part_out, part_lse,
        float(scale) * LOG2E, scale_stride, tokens_per_split, sliding_window or _NO_WINDOW,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        G=group, BLOCK_G=max(16, next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_N=_BLOCK_N, NUM_SPLITS=num_splits,
        HAS_SCALE=has_scale, DOT_F32=dot_in_float32(q.dtype, _decode_kernel), num_warps=4, num_stages=2,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(batch, num_q_heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=num_splits,
            BLOCK_S=next_power_of_2(num_splits), num_warps=4,
        )
    return out
