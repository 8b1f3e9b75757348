"""Prefill / extend attention: variable-length causal attention of new tokens over a cached prefix.

One batch of B requests; request b brings q_len_b new tokens whose K/V were just computed, after
context_lens[b] tokens already in the paged cache (chunked prefill, prefix-cache hits):

    q, k, v         (T, Hq, D), (T, Hk, D), (T, Hk, D)   new tokens of every request, concatenated
    query_start_loc (B + 1,)  request b's new tokens are rows [qsl[b], qsl[b+1])
    context_lens    (B,)      cached prefix length; new token j sits at position context_lens[b] + j
    block_tables    (B, max_blocks) int32, k/v_cache (num_blocks, block_size, Hk, D)
    -> out          (T, Hq, D) in q's dtype

Keys of new token j: cached positions [0, ctx) read through the block table (dequantised when the
cache is float8), then new tokens [0, j] read straight from k and v (contiguous, full precision).
With sliding_window w, only positions (ctx + j - w, ctx + j]: key tiles wholly before a program's
first visible key are skipped, the others masked (WINDOWED, so full-context calls pay nothing).

Tiling. A program owns one KV head and BLOCK_Q consecutive new tokens of one request, and stacks
the G = Hq / Hk query heads sharing that KV head into the rows of one tile, so each key tile feeds
G heads at once (decode-like requests in a mixed batch then still fill G rows, not 1):

    tile row r  ->  token  q_tile * BLOCK_Q + r // G,   query head  kv_head * G + r % G

Grid axis 0 enumerates (request, q_tile) without a device sync: request b's tiles start at
qsl[b] // BLOCK_Q + b (at least as many as it needs, surplus tiles exit at once), so the grid is
T // BLOCK_Q + B and a program finds its request by binary search over query_start_loc.

    request b:  tiles qsl[b]//BQ + b  ...  qsl[b+1]//BQ + b        (BQ = BLOCK_Q)
"""

from __future__ import annotations

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
from ._checks import FLOAT_DTYPES, KV_DTYPES, check_tensor, kv_scales, next_power_of_2
from ._jit import lazy_jit

if TYPE_CHECKING:
    import triton.language as tl


def extend_attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Reference: per request, cached prefix (dequantised) + new keys, causal, float32."""
    out = torch.zeros_like(q)
    qsl = query_start_loc.tolist()
    for b, ctx in enumerate(context_lens.tolist()):
        s, e = qsl[b], qsl[b + 1]
        if s == e:
            continue
        keys = torch.cat((gather_kv_torch(k_cache, block_tables[b], ctx, k_scale), k[s:e].float()))
        values = torch.cat((gather_kv_torch(v_cache, block_tables[b], ctx, v_scale), v[s:e].float()))
        if sliding_window is None:
            out[s:e] = causal_attention_torch(q[s:e].float(), keys, values, scale, ctx).to(q.dtype)
            continue
        for j in range(e - s):  # each token: its own last `sliding_window` keys
            lo = max(0, ctx + j + 1 - sliding_window)
            out[s + j] = causal_attention_torch(q[s + j : s + j + 1].float(), keys[lo : ctx + j + 1],
                                                values[lo : ctx + j + 1], scale, ctx + j - lo)[0].to(q.dtype)
    return out


# ----------------------------------------------------------------------------------------------
# Triton


@lazy_jit
def _find_request(qsl_ptr, num_reqs, pid, BLOCK_Q: tl.constexpr):
    """Largest b in [0, num_reqs) with qsl[b] // BLOCK_Q + b <= pid (tile starts strictly increase)."""
    lo = pid * 0
    hi = lo + num_reqs  # invariant: the answer is in [lo, hi)
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        go_right = tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= pid
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    return lo


@lazy_jit
def _new_token_tile(q, k_ptr, v_ptr, stride_kt, stride_vt, n0, kv_end, tok, d, d_mask,
                    m_i, l_i, acc, qk_scale, window, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr,
                    BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr):
    """Keys n0 .. n0+BLOCK_N of the request's new tokens (k_ptr/v_ptr: its first row, this head)."""
    n = n0 + tl.arange(0, BLOCK_N)
    n_mask = n < kv_end
    rows = n.to(tl.int64)
    k = tl.load(k_ptr + rows[None, :] * stride_kt + d[:, None], mask=d_mask[:, None] & n_mask[None, :], other=0.0)
    v = tl.load(v_ptr + rows[:, None] * stride_vt + d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)
    mask = n_mask[None, :]
    if CAUSAL:
        mask = mask & (n[None, :] <= tok[:, None])
    if WINDOWED:
        mask = mask & (n[None, :] > tok[:, None] - window)
    return online_softmax_step(q, k.to(q.dtype), v.to(q.dtype), m_i, l_i, acc, qk_scale, 1.0, mask, DOT_F32)


@lazy_jit(do_not_specialize=["num_reqs"])
def _extend_kernel(
    q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    qsl_ptr, context_lens_ptr, block_tables_ptr, k_scale_ptr, v_scale_ptr,
    qk_scale, scale_stride, num_reqs, window,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
    stride_bt, stride_ot, stride_oh,
    G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_SCALE: tl.constexpr, DOT_F32: tl.constexpr, WINDOWED: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    b = _find_request(qsl_ptr, num_reqs, pid, BLOCK_Q)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    q_tile = pid - (q_start // BLOCK_Q + b)
    if q_tile * BLOCK_Q >= q_len:  # surplus tile of the sync-free grid
        return
    ctx = tl.load(context_lens_ptr + b)

    r = tl.arange(0, BLOCK_M)
    tok = q_tile * BLOCK_Q + r // G  # new-token index within the request
    heads = kv_head * G + r % G
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    row_mask = (r < BLOCK_Q * G) & (tok < q_len)
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)  # k and v follow q's dtype below

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # 1) cached prefix: every key is visible to every row (without a window)
    prefix_qk_scale = qk_scale
    v_scale = 1.0
    if HAS_SCALE:
        prefix_qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head * scale_stride)
        v_scale = tl.load(v_scale_ptr + kv_head * scale_stride)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    first = 0
    if WINDOWED:  # the tile's first token (position ctx + q_tile * BLOCK_Q) sees nothing earlier
        first = (tl.maximum(ctx + q_tile * BLOCK_Q - window + 1, 0) // BLOCK_N) * BLOCK_N
    for n0 in range(first, ctx, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        n_mask = pos < ctx
        blk, off = paged_slots(bt_row, pos, n_mask, BLOCK_SIZE)
        k_rows = blk * stride_kcb + off * stride_kct + kv_head * stride_kch
        v_rows = blk * stride_vcb + off * stride_vct + kv_head * stride_vch
        k = tl.load(k_cache_ptr + k_rows[None, :] + d[:, None], mask=d_mask[:, None] & n_mask[None, :], other=0.0)
        v = tl.load(v_cache_ptr + v_rows[:, None] + d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        mask = n_mask[None, :]
        if WINDOWED:
            mask = mask & (pos[None, :] > (ctx + tok)[:, None] - window)
        m_i, l_i, acc = online_softmax_step(q, k.to(q.dtype), v.to(q.dtype), m_i, l_i, acc, prefix_qk_scale,
                                            v_scale, mask, DOT_F32)

    # 2) new tokens: keys before this tile's first token need no causal mask, the rest do
    k_base = k_ptr + q_start.to(tl.int64) * stride_kt + kv_head * stride_kh
    v_base = v_ptr + q_start.to(tl.int64) * stride_vt + kv_head * stride_vh
    kv_end = tl.minimum(q_len, (q_tile + 1) * BLOCK_Q)
    diag_start = (q_tile * BLOCK_Q // BLOCK_N) * BLOCK_N
    first = 0
    if WINDOWED:
        first = (tl.maximum(q_tile * BLOCK_Q - window + 1, 0) // BLOCK_N) * BLOCK_N
    for n0 in range(first, diag_start, BLOCK_N):
        m_i, l_i, acc = _new_token_tile(q, k_base, v_base, stride_kt, stride_vt, n0, kv_end, tok, d, d_mask,
                                        m_i, l_i, acc, qk_scale, window, False, WINDOWED, BLOCK_N, DOT_F32)
    for n0 in range(tl.maximum(diag_start, first), kv_end, BLOCK_N):
        m_i, l_i, acc = _new_token_tile(q, k_base, v_base, stride_kt, stride_vt, n0, kv_end, tok, d, d_mask,
                                        m_i, l_i, acc, qk_scale, window, True, WINDOWED, BLOCK_N, DOT_F32)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def _tile_config(group: int, head_dim: int, dot_f32: bool) -> tuple[int, int, int, int]:
    """-> (BLOCK_M rows, BLOCK_N keys, num_warps, num_stages). 128x64 tiles with 8 warps are the
    usual flash-attention sweet spot for 16-bit head_dim <= 128; float32 operands need half."""
    block_m, block_n, warps = (64, 32, 4) if dot_f32 or head_dim > 128 else (128, 64, 8)
    return max(block_m, next_power_of_2(group)), block_n, warps, 2 if dot_f32 else 3


def extend_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
    *,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Extend attention (see the module docstring). Rows of out past query_start_loc[-1] (padding
    tokens) are left untouched. No device sync."""
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    num_tokens, num_q_heads, head_dim = q.shape
    dev = q.device
    check_tensor("k_cache", k_cache, ndim=4, dtypes=KV_DTYPES, device=dev)
    num_kv_heads = k_cache.shape[2]
    check_tensor("k_cache", k_cache, shape=(None, None, num_kv_heads, head_dim))
    check_tensor("v_cache", v_cache, shape=tuple(k_cache.shape), dtypes=(k_cache.dtype,), device=dev)
    check_tensor("k", k, shape=(num_tokens, num_kv_heads, head_dim), dtypes=(q.dtype,), device=dev)
    check_tensor("v", v, shape=(num_tokens, num_kv_heads, head_dim), dtypes=(q.dtype,), device=dev)
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32, torch.int64), device=dev)
    num_reqs = block_tables.shape[0]
    for name, t, n in (("query_start_loc", query_start_loc, num_reqs + 1), ("context_lens", context_lens, num_reqs)):
        check_tensor(name, t, shape=(n,), dtypes=(torch.int32, torch.int64), device=dev, last_dim_contiguous=False)
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q: num_heads {num_q_heads} must be a multiple of k_cache's num_kv_heads {num_kv_heads}")
    ks, vs, scale_stride, has_scale = kv_scales(k_cache.dtype, k_scale, v_scale, num_kv_heads, dev)
    if out is None:
        out = torch.empty_like(q)
    check_tensor("out", out, shape=tuple(q.shape), dtypes=(q.dtype,), device=dev)
    if num_tokens == 0 or num_reqs == 0:
        return out

    group = num_q_heads // num_kv_heads
    dot_f32 = dot_in_float32(q.dtype, _extend_kernel)
    block_m, block_n, num_warps, num_stages = _tile_config(group, head_dim, dot_f32)
    block_q = block_m // group
    qsl, ctx = query_start_loc.contiguous(), context_lens.contiguous()
    grid = (num_tokens // block_q + num_reqs, num_kv_heads)
    _extend_kernel[grid](
        q, k, v, k_cache, v_cache, out, qsl, ctx, block_tables,
        ks if has_scale else ctx, vs if has_scale else ctx,
        float(scale) * LOG2E, scale_stride, num_reqs, sliding_window or 0,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        G=group, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1], BLOCK_N=block_n, HAS_SCALE=has_scale, DOT_F32=dot_f32,
        WINDOWED=sliding_window is not None, num_warps=num_warps, num_stages=num_stages,
    )
    return out
