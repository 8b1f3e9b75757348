"""Paged decode attention (split-KV, GQA, float8 KV) against its torch reference."""

from __future__ import annotations

import pytest
import torch

from pdcluster.kernels.paged_attention import paged_decode_attention_torch, paged_decode_attention_triton

# Lengths: empty request, single token, not multiples of any block size, one spanning many tiles.
SEQ_LENS = [0, 1, 17, 70]


def _run(make_paged_kv, device, seq_lens, group, head_dim, block_size, case, num_kv_heads=2, **kw):
    kv = make_paged_kv(seq_lens, num_kv_heads, head_dim, block_size, case)
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, device=device, dtype=kv.dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, lens, head_dim**-0.5, kv.k_scale, kv.v_scale)
    return paged_decode_attention_triton(*args, **kw), paged_decode_attention_torch(*args), kv.dtype


@pytest.mark.parametrize("group", [1, 4, 8])
def test_dtypes_and_gqa(make_paged_kv, device, assert_close, kv_case, group):
    out, ref, dtype = _run(make_paged_kv, device, SEQ_LENS, group, 64, 16, kv_case)
    assert_close(out, ref, dtype, "attention")


@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_block_sizes_and_head_dims(make_paged_kv, device, assert_close, block_size, head_dim):
    out, ref, dtype = _run(make_paged_kv, device, [5, 33, 1], 4, head_dim, block_size, "bf16")
    assert_close(out, ref, dtype, "attention")


@pytest.mark.parametrize("num_splits", [2, 3, 8])
@pytest.mark.parametrize("case", ["f32", "bf16-fp8-tensor"])
def test_split_kv_reduction(make_paged_kv, device, assert_close, case, num_splits):
    # Splits are multiples of 64 keys: 200 keys -> up to 4 splits, some empty for the short requests.
    out, ref, dtype = _run(make_paged_kv, device, [200, 0, 65, 1], 4, 64, 16, case, num_splits=num_splits)
    assert_close(out, ref, dtype, "attention")


def test_single_request_single_token(make_paged_kv, device, assert_close):
    out, ref, dtype = _run(make_paged_kv, device, [1], 1, 128, 32, "f16")
    assert_close(out, ref, dtype, "attention")


def test_empty_batch(make_paged_kv, device):
    out, ref, _ = _run(make_paged_kv, device, [], 4, 64, 16, "bf16")
    assert out.shape == ref.shape == (0, 8, 64)


def test_max_seq_len_and_out_argument(make_paged_kv, device, assert_close):
    kv = make_paged_kv([9, 40], 1, 64, 16, "f16")
    q = torch.randn(2, 8, 64, device=device, dtype=torch.float16)
    lens = torch.tensor([9, 40], dtype=torch.int32, device=device)
    out = torch.full_like(q, float("nan"))
    got = paged_decode_attention_triton(q, kv.k_cache, kv.v_cache, kv.block_tables, lens, 0.125,
                                        max_seq_len=40, out=out)
    assert got is out
    ref = paged_decode_attention_torch(q, kv.k_cache, kv.v_cache, kv.block_tables, lens, 0.125)
    assert_close(out, ref, torch.float16, "attention")


def test_strided_engine_cache_view(device, assert_close):
    # The runner passes kv_cache[layer][0] of the engine's (L, 2, num_blocks, N, H, C) tensor.
    engine = torch.randn(2, 2, 6, 16, 2, 64, device=device, dtype=torch.bfloat16)
    k_cache, v_cache = engine[1, 0], engine[1, 1]
    q = torch.randn(2, 4, 64, device=device, dtype=torch.bfloat16)
    block_tables = torch.tensor([[3, 1, 0], [5, 2, 4]], dtype=torch.int32, device=device)
    lens = torch.tensor([20, 47], dtype=torch.int32, device=device)
    out = paged_decode_attention_triton(q, k_cache, v_cache, block_tables, lens, 0.125)
    ref = paged_decode_attention_torch(q, k_cache, v_cache, block_tables, lens, 0.125)
    assert_close(out, ref, torch.bfloat16, "attention")


def test_argument_errors(device):
    q = torch.randn(2, 4, 64, device=device, dtype=torch.float16)
    cache = torch.zeros(4, 16, 2, 64, device=device, dtype=torch.float16)
    bt = torch.zeros(2, 2, dtype=torch.int32, device=device)
    lens = torch.ones(2, dtype=torch.int32, device=device)
    fp8 = cache.to(torch.float8_e4m3fn)
    bad_q = torch.randn(2, 3, 64, device=device, dtype=torch.float16)
    cases = [
        ("q: num_heads", (bad_q, cache, cache, bt, lens, 1.0), {}),
        ("v_cache", (q, cache, cache.float(), bt, lens, 1.0), {}),
        ("block_tables", (q, cache, cache, bt.float(), lens, 1.0), {}),
        ("seq_lens", (q, cache, cache, bt, lens[:1], 1.0), {}),
        ("k_scale", (q, cache, cache, bt, lens, 1.0), {"k_scale": 1.0}),
        ("k_scale", (q, fp8, fp8, bt, lens, 1.0), {"k_scale": torch.ones(3, device=device)}),
        ("out", (q, cache, cache, bt, lens, 1.0), {"out": torch.empty(2, 4, 32, device=device)}),
    ]
    for match, args, kw in cases:
        with pytest.raises(ValueError, match=match):
            paged_decode_attention_triton(*args, **kw)
