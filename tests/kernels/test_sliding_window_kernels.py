"""Sliding windows in the Triton attention kernels (paged decode, extend) against their torch
references, and the references against the torch attention backend's own window mask."""

from __future__ import annotations

import pytest
import torch

from pdcluster.kernels.extend_attention import extend_attention_torch, extend_attention_triton
from pdcluster.kernels.paged_attention import paged_decode_attention_torch, paged_decode_attention_triton


def _decode(make_paged_kv, device, seq_lens, window, case="f32", group=4, num_splits=None):
    kv = make_paged_kv(seq_lens, 2, 64, 16, case)
    q = torch.randn(len(seq_lens), 2 * group, 64, device=device, dtype=kv.dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, lens, 64**-0.5, kv.k_scale, kv.v_scale)
    out = paged_decode_attention_triton(*args, sliding_window=window, num_splits=num_splits)
    return out, paged_decode_attention_torch(*args, sliding_window=window), paged_decode_attention_torch(*args), kv


@pytest.mark.parametrize("window", [1, 7, 64, 150])
@pytest.mark.parametrize("num_splits", [None, 3])
def test_decode_window(make_paged_kv, device, assert_close, window, num_splits):
    out, ref, full, kv = _decode(make_paged_kv, device, [200, 0, 65, 1, 9], window, num_splits=num_splits)
    assert_close(out, ref, kv.dtype, "attention")
    assert not torch.allclose(ref[0], full[0])  # the 200-token request really lost its old keys


@pytest.mark.parametrize("case", ["bf16", "bf16-fp8-tensor"])
def test_decode_window_dtypes(make_paged_kv, device, assert_close, case):
    out, ref, _, kv = _decode(make_paged_kv, device, [90, 5, 33], 20, case=case)
    assert_close(out, ref, kv.dtype, "attention")


def _extend(make_paged_kv, device, batch, window, case="f32", group=4):
    ctx = [c for c, _ in batch]
    kv = make_paged_kv(ctx, 2, 64, 16, case)
    qlens = [n for _, n in batch]
    num_tokens = sum(qlens)
    q = torch.randn(num_tokens, 2 * group, 64, device=device, dtype=kv.dtype)
    kvt = torch.randn(num_tokens, 2, 2, 64, device=device, dtype=kv.dtype)
    k, v = kvt[:, 0], kvt[:, 1]
    qsl = torch.tensor([0, *qlens], device=device).cumsum(0).to(torch.int32)
    ctx_t = torch.tensor(ctx, dtype=torch.int32, device=device)
    args = (q, k, v, kv.k_cache, kv.v_cache, qsl, ctx_t, kv.block_tables, 64**-0.5, kv.k_scale, kv.v_scale)
    return extend_attention_triton(*args, sliding_window=window), extend_attention_torch(*args, sliding_window=window), kv


@pytest.mark.parametrize("window", [1, 5, 32, 100])
@pytest.mark.parametrize("group", [1, 4])
def test_extend_window(make_paged_kv, device, assert_close, window, group):
    # fresh prefill longer than the window, a chunk after a long prefix, decode-like, empty
    batch = [(0, 41), (13, 9), (70, 30), (45, 1), (5, 0)]
    out, ref, kv = _extend(make_paged_kv, device, batch, window, group=group)
    assert_close(out, ref, kv.dtype, "attention")


def test_extend_window_spans_query_tiles(make_paged_kv, device, assert_close):
    out, ref, kv = _extend(make_paged_kv, device, [(20, 150), (3, 2)], 37, case="bf16", group=1)
    assert_close(out, ref, kv.dtype, "attention")


def test_window_references_agree_with_the_torch_backend():
    """The kernels' references and TorchAttentionBackend mask the same keys."""
    from models.test_layers import build_meta

    from pdcluster.models.layers.torch_attention import TorchAttentionBackend

    torch.manual_seed(0)
    ctx, qlens, bs, window = [7, 0, 13, 30], [1, 9, 4, 1], 4, 6
    meta = build_meta(ctx, qlens, bs, 60)
    k_cache, v_cache = torch.randn(60, bs, 2, 8), torch.randn(60, bs, 2, 8)
    q, k, v = torch.randn(sum(qlens), 4, 8), torch.randn(sum(qlens), 2, 8), torch.randn(sum(qlens), 2, 8)
    ref = extend_attention_torch(q, k, v, k_cache.clone(), v_cache.clone(), meta.query_start_loc,
                                 meta.context_lens, meta.block_tables, 8**-0.5, sliding_window=window)
    got = TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, 8**-0.5, sliding_window=window)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
