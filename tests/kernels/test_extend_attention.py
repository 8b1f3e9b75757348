"""Extend (prefill / chunked prefill / prefix-hit) attention against its torch reference."""

from __future__ import annotations

import pytest
import torch

from pdcluster.kernels.extend_attention import extend_attention_torch, extend_attention_triton

# (context_len, query_len) per request: fresh prefill, prefix hit not on a block boundary, a chunk
# after a long prefix, a decode-like single token, a request with no new tokens.
BATCH = [(0, 21), (13, 9), (45, 30), (70, 1), (5, 0)]


def _run(make_paged_kv, device, batch, group, head_dim, block_size, case, num_kv_heads=2):
    ctx = [c for c, _ in batch]
    kv = make_paged_kv(ctx, num_kv_heads, head_dim, block_size, case)
    qlens = [n for _, n in batch]
    num_tokens = sum(qlens)
    q = torch.randn(num_tokens, num_kv_heads * group, head_dim, device=device, dtype=kv.dtype)
    # k and v as strided views of one fused tensor, as the attention layer produces them
    kvt = torch.randn(num_tokens, 2, num_kv_heads, head_dim, device=device, dtype=kv.dtype)
    k, v = kvt[:, 0], kvt[:, 1]
    qsl = torch.tensor([0, *qlens], device=device).cumsum(0).to(torch.int32)
    ctx_t = torch.tensor(ctx, dtype=torch.int32, device=device)
    args = (q, k, v, kv.k_cache, kv.v_cache, qsl, ctx_t, kv.block_tables, head_dim**-0.5, kv.k_scale, kv.v_scale)
    return extend_attention_triton(*args), extend_attention_torch(*args), kv.dtype


@pytest.mark.parametrize("group", [1, 4, 8])
def test_dtypes_and_gqa(make_paged_kv, device, assert_close, kv_case, group):
    out, ref, dtype = _run(make_paged_kv, device, BATCH, group, 64, 16, kv_case)
    assert_close(out, ref, dtype, "attention")


@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_block_sizes_and_head_dims(make_paged_kv, device, assert_close, block_size, head_dim):
    out, ref, dtype = _run(make_paged_kv, device, [(0, 7), (19, 12), (33, 1)], 4, head_dim, block_size, "bf16")
    assert_close(out, ref, dtype, "attention")


def test_long_prefill_spans_query_tiles(make_paged_kv, device, assert_close):
    # 150 tokens with G = 1 needs two 128-row query tiles and several causal key tiles.
    out, ref, dtype = _run(make_paged_kv, device, [(0, 150), (3, 2)], 1, 64, 16, "f16")
    assert_close(out, ref, dtype, "attention")


def test_single_token_batch(make_paged_kv, device, assert_close):
    out, ref, dtype = _run(make_paged_kv, device, [(0, 1)], 8, 128, 32, "f32")
    assert_close(out, ref, dtype, "attention")


def test_empty_batch(make_paged_kv, device):
    out, ref, _ = _run(make_paged_kv, device, [], 4, 64, 16, "bf16")
    assert out.shape == ref.shape == (0, 8, 64)


def test_padding_rows_untouched(make_paged_kv, device, assert_close):
    kv = make_paged_kv([4], 2, 64, 16, "bf16")
    q = torch.randn(8, 4, 64, device=device, dtype=torch.bfloat16)  # 5 real tokens + 3 padding rows
    k = torch.randn(8, 2, 64, device=device, dtype=torch.bfloat16)
    v = torch.randn(8, 2, 64, device=device, dtype=torch.bfloat16)
    qsl = torch.tensor([0, 5], dtype=torch.int32, device=device)
    ctx = torch.tensor([4], dtype=torch.int32, device=device)
    out = torch.full_like(q, 7.0)
    extend_attention_triton(q, k, v, kv.k_cache, kv.v_cache, qsl, ctx, kv.block_tables, 0.125, out=out)
    ref = extend_attention_torch(q, k, v, kv.k_cache, kv.v_cache, qsl, ctx, kv.block_tables, 0.125)
    assert_close(out[:5], ref[:5], torch.bfloat16, "attention")
    assert bool((out[5:] == 7.0).all())


def test_argument_errors(device):
    q = torch.randn(3, 4, 64, device=device, dtype=torch.float16)
    k = torch.randn(3, 2, 64, device=device, dtype=torch.float16)
    cache = torch.zeros(4, 16, 2, 64, device=device, dtype=torch.float16)
    bt = torch.zeros(1, 2, dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 3], dtype=torch.int32, device=device)
    ctx = torch.zeros(1, dtype=torch.int32, device=device)
    cases = [
        ("k must have shape", (q, k[:2], k, cache, cache, qsl, ctx, bt, 1.0)),
        ("v must have dtype", (q, k, k.float(), cache, cache, qsl, ctx, bt, 1.0)),
        ("query_start_loc", (q, k, k, cache, cache, qsl[:1], ctx, bt, 1.0)),
        ("context_lens", (q, k, k, cache, cache, qsl, ctx.float(), bt, 1.0)),
        ("k_cache", (q, k, k, cache[..., :32], cache, qsl, ctx, bt, 1.0)),
    ]
    for match, args in cases:
        with pytest.raises(ValueError, match=match):
            extend_attention_triton(*args)
