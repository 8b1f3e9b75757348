"""KV block packing: layouts, head ranges, round trips, heterogeneous-TP reassembly."""

from __future__ import annotations

import pytest
import torch

from pdcluster.kernels.kv_pack import (
    LAYOUTS,
    pack_kv_blocks_torch,
    pack_kv_blocks_triton,
    pack_shape,
    unpack_kv_blocks_torch,
    unpack_kv_blocks_triton,
)

L, NUM_BLOCKS, N, H, C = 2, 7, 16, 4, 80  # odd head_dim on purpose


def _cache(device, dtype=torch.bfloat16, heads=H, block_size=N):
    return torch.randn(L, 2, NUM_BLOCKS, block_size, heads, C, device=device).to(dtype)


@pytest.mark.parametrize(("h0", "h1"), [(0, 4), (1, 3), (3, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_pack_matches_reference_and_round_trips(device, layout, dtype, h0, h1):
    cache = _cache(device, dtype)
    ids = torch.tensor([5, 0, 3], device=device)
    buf = torch.empty(pack_shape(layout, L, 3, h1 - h0, N, C), device=device, dtype=dtype)
    pack_kv_blocks_triton(cache, ids, buf, layout, h0, h1)
    ref = pack_kv_blocks_torch(cache, ids, torch.empty_like(buf), layout, h0, h1)
    assert torch.equal(buf.view(torch.uint8), ref.view(torch.uint8))
    # unpack(pack(x)) is the identity on the selected blocks and heads, and touches nothing else
    out = torch.zeros_like(cache)
    unpack_kv_blocks_triton(buf, out, ids, layout, h0, h1)
    expect = torch.zeros_like(cache)
    unpack_kv_blocks_torch(ref, expect, ids, layout, h0, h1)
    assert torch.equal(out.view(torch.uint8), expect.view(torch.uint8))
    assert torch.equal(out[:, :, ids.long(), :, h0:h1].view(torch.uint8),
                       cache[:, :, ids.long(), :, h0:h1].view(torch.uint8))


@pytest.mark.parametrize("block_size", [1, 32])
def test_block_sizes(device, block_size):
    cache = _cache(device, torch.float16, block_size=block_size)
    ids = torch.tensor([6, 2], dtype=torch.int32, device=device)
    for layout in LAYOUTS:
        buf = torch.empty(pack_shape(layout, L, 2, H, block_size, C), device=device, dtype=cache.dtype)
        pack_kv_blocks_triton(cache, ids, buf, layout)
        assert torch.equal(buf, pack_kv_blocks_torch(cache, ids, torch.empty_like(buf), layout))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tp2_to_tp1_reassembles_heads(device, layout):
    full = _cache(device)  # what a TP=1 rank holds: all H heads
    half = H // 2
    tp2 = [full[..., r * half : (r + 1) * half, :].contiguous() for r in range(2)]  # each TP=2 rank's cache
    src_ids = torch.tensor([1, 4, 6], device=device)
    dst_ids = torch.tensor([2, 0, 5], device=device)
    dst = torch.zeros_like(full)
    for r, cache in enumerate(tp2):  # each producer rank packs all of its local heads
        buf = torch.empty(pack_shape(layout, L, 3, half, N, C), device=device, dtype=full.dtype)
        pack_kv_blocks_triton(cache, src_ids, buf, layout)
        unpack_kv_blocks_triton(buf, dst, dst_ids, layout, r * half, (r + 1) * half)  # consumer: its head slice
    assert torch.equal(dst[:, :, dst_ids], full[:, :, src_ids])


def test_tp1_to_tp2_into_one_head_major_buffer(device):
    # Head-major: each TP=2 rank's slice of a full-head buffer is a strided view of it, so the
    # producer ranks pack straight into one buffer and a TP=1 consumer unpacks it in one go.
    full = _cache(device)
    half = H // 2
    tp2 = [full[..., r * half : (r + 1) * half, :].contiguous() for r in range(2)]
    ids = torch.tensor([3, 1], device=device)
    buf = torch.empty(pack_shape("LBHNC", L, 2, H, N, C), device=device, dtype=full.dtype)
    for r, cache in enumerate(tp2):
        pack_kv_blocks_triton(cache, ids, buf[:, :, :, r * half : (r + 1) * half], "LBHNC")
    dst = torch.zeros_like(full)
    unpack_kv_blocks_triton(buf, dst, ids, "LBHNC")
    assert torch.equal(dst[:, :, ids], full[:, :, ids])
    # ... and a TP=1 producer's buffer splits back into the two TP=2 caches by head slices
    back = [torch.zeros_like(c) for c in tp2]
    for r in range(2):
        unpack_kv_blocks_triton(buf[:, :, :, r * half : (r + 1) * half], back[r], ids, "LBHNC")
        assert torch.equal(back[r][:, :, ids], tp2[r][:, :, ids])


def test_block_major_buffer_view(device):
    # A store connector may allocate (nblocks, 2, L, h, N, C) so each block is one contiguous object.
    cache = _cache(device)
    ids = torch.tensor([4, 2, 6], device=device)
    storage = torch.empty(3, 2, L, H, N, C, device=device, dtype=cache.dtype)
    pack_kv_blocks_triton(cache, ids, storage.permute(1, 2, 0, 3, 4, 5), "LBHNC")
    ref = pack_kv_blocks_torch(cache, ids, torch.empty(pack_shape("LBHNC", L, 3, H, N, C), device=device,
                                                       dtype=cache.dtype), "LBHNC")
    assert torch.equal(storage, ref.permute(2, 0, 1, 3, 4, 5))


def test_empty_block_list(device):
    cache = _cache(device)
    ids = torch.zeros(0, dtype=torch.int64, device=device)
    buf = torch.empty(pack_shape("LBNHC", L, 0, H, N, C), device=device, dtype=cache.dtype)
    pack_kv_blocks_triton(cache, ids, buf, "LBNHC")
    unpack_kv_blocks_triton(buf, cache, ids, "LBNHC")


def test_argument_errors(device):
    cache = _cache(device)
    ids = torch.tensor([1], device=device)
    buf = torch.empty(pack_shape("LBHNC", L, 1, H, N, C), device=device, dtype=cache.dtype)
    with pytest.raises(ValueError, match="layout"):
        pack_kv_blocks_triton(cache, ids, buf, "BLHNC")
    with pytest.raises(ValueError, match="head range"):
        pack_kv_blocks_triton(cache, ids, buf, "LBHNC", 2, 2)
    with pytest.raises(ValueError, match="buffer must have shape"):
        pack_kv_blocks_triton(cache, ids, buf, "LBNHC")
    with pytest.raises(ValueError, match="buffer must have dtype"):
        pack_kv_blocks_triton(cache, ids, buf.float(), "LBHNC")
    with pytest.raises(ValueError, match="kv_cache"):
        pack_kv_blocks_triton(cache[0], ids, buf, "LBHNC")
    with pytest.raises(ValueError, match="block_ids"):
        pack_kv_blocks_triton(cache, ids.float(), buf, "LBHNC")
