"""Compiled kernels on CUDA at realistic sizes (skipped without CUDA; the interpreter would take hours)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdcluster.kernels.extend_attention import extend_attention_triton
from pdcluster.kernels.kv_pack import pack_kv_blocks_torch, pack_kv_blocks_triton, pack_shape
from pdcluster.kernels.paged_attention import paged_decode_attention_torch, paged_decode_attention_triton

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_long_context_decode_auto_splits(make_paged_kv, assert_close, cache_dtype):
    case = "bf16" if cache_dtype == torch.bfloat16 else "bf16-fp8-tensor"
    seq_lens = [8191, 3, 5000]
    kv = make_paged_kv(seq_lens, 8, 128, 16, case)
    q = torch.randn(3, 32, 128, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, lens, 128**-0.5, kv.k_scale, kv.v_scale)
    assert_close(paged_decode_attention_triton(*args), paged_decode_attention_torch(*args), torch.bfloat16, "attention")


def test_prefill_matches_sdpa():
    n, hq, hk, d = 1500, 32, 8, 128
    q = torch.randn(n, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(n, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(n, hk, d, device="cuda", dtype=torch.bfloat16)
    cache = torch.zeros(1, 16, hk, d, device="cuda", dtype=torch.bfloat16)
    qsl = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    ctx = torch.zeros(1, dtype=torch.int32, device="cuda")
    bt = torch.zeros(1, 1, dtype=torch.int32, device="cuda")
    out = extend_attention_triton(q, k, v, cache, cache, qsl, ctx, bt, d**-0.5)
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(4, 1).transpose(0, 1),
                                         v.repeat_interleave(4, 1).transpose(0, 1), is_causal=True).transpose(0, 1)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=2e-2)


def test_pack_large():
    cache = torch.randn(32, 2, 512, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    ids = torch.randperm(512, device="cuda")[:100]
    for layout in ("LBHNC", "LBNHC"):
        buf = torch.empty(pack_shape(layout, 32, 100, 4, 16, 128), device="cuda", dtype=cache.dtype)
        pack_kv_blocks_triton(cache, ids, buf, layout, 2, 6)
        assert torch.equal(buf, pack_kv_blocks_torch(cache, ids, torch.empty_like(buf), layout, 2, 6))
