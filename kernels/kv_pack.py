"""KV block packing: gather blocks of the paged cache into a contiguous transfer buffer, and back.

The engine keeps one cache tensor per rank:

    kv_cache (L, 2, num_blocks, N, H, C)      L layers, K/V, N = block_size tokens, H local KV heads,
                                              C = head_dim channels

Transfer buffers hold `nblocks` listed blocks, for the head range [h0, h1) (h = h1 - h0), with K and
V kept separate (index 0 / 1 of the first dimension):

    layout "LBHNC" (head-major):   buffer (2, L, nblocks, h, N, C)
    layout "LBNHC" (token-major):  buffer (2, L, nblocks, N, h, C)

    buffer[kv, l, i, ...] <-> kv_cache[l, kv, block_ids[i], :, h0:h1, :]   (permuted as named)

Head-major keeps every head's N*C values contiguous, so a TP rank owning a head slice reads or
writes plain contiguous runs (heterogeneous TP, StoreLayout shards); token-major matches the
paged cache's own order, so a full-head pack copies whole (h*C)-long rows.

The buffer may be any strided view with that logical shape whose channel dimension is contiguous,
for example one TP rank's head slice `full_buffer[:, :, :, r*h:(r+1)*h]` of a head-major buffer
that holds all heads, or a block-major allocation (nblocks, 2, L, h, N, C) permuted to the logical
order. `pack` and `unpack` are exact copies (any dtype, float8 included): unpack(pack(x)) == x.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ._checks import INDEX_DTYPES, check_tensor, next_power_of_2
from ._jit import lazy_jit

if TYPE_CHECKING:
    import triton.language as tl

LAYOUTS = ("LBHNC", "LBNHC")


def pack_shape(layout: str, num_layers: int, num_blocks: int, num_heads: int, block_size: int,
               head_dim: int) -> tuple[int, ...]:
    """Shape of a transfer buffer holding `num_blocks` blocks of `num_heads` heads."""
    if layout == "LBHNC":
        return (2, num_layers, num_blocks, num_heads, block_size, head_dim)
    if layout == "LBNHC":
        return (2, num_layers, num_blocks, block_size, num_heads, head_dim)
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _cache_view(kv_cache: torch.Tensor, block_ids: torch.Tensor, h0: int, h1: int) -> torch.Tensor:
    """(L, 2, nb, N, H, C) -> the selected blocks and heads as (2, L, nblocks, N, h, C), a copy."""
    return kv_cache[:, :, block_ids.long(), :, h0:h1].transpose(0, 1)


def pack_kv_blocks_torch(kv_cache: torch.Tensor, block_ids: torch.Tensor, buffer: torch.Tensor,
                         layout: str = "LBHNC", h0: int = 0, h1: int | None = None) -> torch.Tensor:
    """Reference gather: buffer <- the blocks `block_ids`, heads [h0, h1), in `layout`."""
    h1 = kv_cache.shape[4] if h1 is None else h1
    src = _cache_view(kv_cache, block_ids, h0, h1)  # (2, L, nblocks, N, h, C)
    buffer.copy_(src.transpose(3, 4) if layout == "LBHNC" else src)
    return buffer


def unpack_kv_blocks_torch(buffer: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor,
                           layout: str = "LBHNC", h0: int = 0, h1: int | None = None) -> torch.Tensor:
    """Reference scatter: the blocks `block_ids`, heads [h0, h1) of kv_cache <- buffer."""
    h1 = kv_cache.shape[4] if h1 is None else h1
    src = buffer.transpose(3, 4) if layout == "LBHNC" else buffer  # (2, L, nblocks, N, h, C)
    ids = block_ids.long()
    for kv in range(2):
        for layer in range(kv_cache.shape[0]):
            kv_cache[layer, kv, ids, :, h0:h1] = src[kv, layer]
    return kv_cache


# ----------------------------------------------------------------------------------------------
# Triton
#
# Grid (nblocks, L, 2): one program moves one block of one layer of K or V, h*N rows of C channels.
# Rows are visited in the buffer's memory order so its side is written (pack) or read (unpack) in
# long contiguous runs; the cache side is contiguous per row (C channels) and, for token-major with
# all heads, across rows too.
#
#     row r (head-major):  head = r // N, token = r % N        row r (token-major): token = r // h, head = r % h
#     cache  kv_cache[l, kv, block_ids[i], token, h0 + head, :]
#     buffer buffer  [kv, l, i, head, token, :]   (strides given, so any view works)


@lazy_jit
def _kv_pack_kernel(
    cache_ptr, buf_ptr, block_ids_ptr, h0, num_heads,
    sc_l, sc_kv, sc_b, sc_n, sc_h,
    sb_kv, sb_l, sb_b, sb_h, sb_n,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    HEAD_MAJOR: tl.constexpr, PACK: tl.constexpr,
):
    i = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    kv = tl.program_id(2).to(tl.int64)
    block = tl.load(block_ids_ptr + i).to(tl.int64)
    cache_base = cache_ptr + layer * sc_l + kv * sc_kv + block * sc_b + h0 * sc_h
    buf_base = buf_ptr + kv * sb_kv + layer * sb_l + i.to(tl.int64) * sb_b
    c = tl.arange(0, BLOCK_C)
    num_rows = num_heads * BLOCK_SIZE
    for r0 in range(0, num_rows, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        if HEAD_MAJOR:
            head = r // BLOCK_SIZE
            tok = r % BLOCK_SIZE
        else:
            tok = r // num_heads
            head = r % num_heads
        mask = (r < num_rows)[:, None] & (c < HEAD_DIM)[None, :]
        cache_ptrs = cache_base + (tok.to(tl.int64) * sc_n + head * sc_h)[:, None] + c[None, :]
        buf_ptrs = buf_base + (head.to(tl.int64) * sb_h + tok * sb_n)[:, None] + c[None, :]
        if PACK:
            tl.store(buf_ptrs, tl.load(cache_ptrs, mask=mask), mask=mask)
        else:
            tl.store(cache_ptrs, tl.load(buf_ptrs, mask=mask), mask=mask)


_BITS_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _launch(kv_cache: torch.Tensor, block_ids: torch.Tensor, buffer: torch.Tensor, layout: str,
            h0: int, h1: int | None, pack: bool) -> None:
    check_tensor("kv_cache", kv_cache, ndim=6)
    num_layers, two, _, block_size, num_heads, head_dim = kv_cache.shape
    if two != 2:
        raise ValueError(f"kv_cache must be (L, 2, num_blocks, block_size, H, head_dim), got {tuple(kv_cache.shape)}")
    h1 = num_heads if h1 is None else h1
    if not 0 <= h0 < h1 <= num_heads:
        raise ValueError(f"head range [h0, h1) = [{h0}, {h1}) must be non-empty and within [0, {num_heads})")
    check_tensor("block_ids", block_ids, ndim=1, dtypes=INDEX_DTYPES, device=kv_cache.device,
                 last_dim_contiguous=False)
    shape = pack_shape(layout, num_layers, block_ids.shape[0], h1 - h0, block_size, head_dim)
    check_tensor("buffer", buffer, shape=shape, dtypes=(kv_cache.dtype,), device=kv_cache.device)
    if block_ids.numel() == 0:
        return
    if kv_cache.element_size() not in _BITS_VIEW:
        raise ValueError(f"kv_cache: unsupported element size {kv_cache.element_size()}")
    # A pure copy: move raw bits so every dtype (float8 included) takes the same path on any GPU.
    bits = _BITS_VIEW[kv_cache.element_size()]
    cache_bits, buf_bits = kv_cache.view(bits), buffer.view(bits)
    # Buffer strides in logical (kv, l, block, head, token) order, whatever the layout.
    sb = buffer.stride()
    sb_kv, sb_l, sb_b, sb_h, sb_n = (sb[0], sb[1], sb[2], sb[3], sb[4]) if layout == "LBHNC" else \
        (sb[0], sb[1], sb[2], sb[4], sb[3])
    block_c = next_power_of_2(head_dim)
    block_r = max(1, min(next_power_of_2((h1 - h0) * block_size), 8192 // block_c))
    sc = kv_cache.stride()
    _kv_pack_kernel[(block_ids.shape[0], num_layers, 2)](
        cache_bits, buf_bits, block_ids.contiguous(), h0, h1 - h0,
        sc[0], sc[1], sc[2], sc[3], sc[4], sb_kv, sb_l, sb_b, sb_h, sb_n,
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_R=block_r, BLOCK_C=block_c,
        HEAD_MAJOR=layout == "LBHNC", PACK=pack, num_warps=8 if block_r * block_c >= 8192 else 4,
    )


def pack_kv_blocks_triton(kv_cache: torch.Tensor, block_ids: torch.Tensor, buffer: torch.Tensor,
                          layout: str = "LBHNC", h0: int = 0, h1: int | None = None) -> torch.Tensor:
    """Gather: buffer (see pack_shape) <- blocks `block_ids`, heads [h0, h1) of kv_cache. Returns buffer."""
    _launch(kv_cache, block_ids, buffer, layout, h0, h1, pack=True)
    return buffer


def unpack_kv_blocks_triton(buffer: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor,
                            layout: str = "LBHNC", h0: int = 0, h1: int | None = None) -> torch.Tensor:
    """Scatter: blocks `block_ids`, heads [h0, h1) of kv_cache <- buffer. Returns kv_cache.
    block_ids must not repeat (two programs would race on one block)."""
    _launch(kv_cache, block_ids, buffer, layout, h0, h1, pack=False)
    return kv_cache
