"""TritonAttentionBackend against plain torch attention math on mixed batches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdcluster.kernels.cache_write import reshape_and_cache_torch
from pdcluster.models.layers.attention_backend import AttentionMetadata
from pdcluster.models.layers.triton_attention import TritonAttentionBackend

HQ, HK, D, BS = 8, 2, 64, 16


def _setup(device, batch, dtype, cache_dtype, num_padding=0, scale=None):
    """batch: [(context_len, query_len)]. Fills each cached prefix, returns everything forward needs
    plus the full float32 K/V per request (prefix as stored in the cache + new tokens)."""
    num_blocks = sum(-(-(c + n) // BS) for c, n in batch) + 2
    k_cache = torch.zeros(num_blocks, BS, HK, D, device=device).to(cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    perm = torch.randperm(num_blocks, device=device)
    width = max(-(-(c + n) // BS) for c, n in batch)
    block_tables = torch.zeros(len(batch), width, dtype=torch.int32, device=device)
    qlens = [n for _, n in batch]
    num_tokens = sum(qlens) + num_padding
    q = torch.randn(num_tokens, HQ, D, device=device, dtype=dtype)
    k = torch.randn(num_tokens, HK, D, device=device, dtype=dtype)
    v = torch.randn(num_tokens, HK, D, device=device, dtype=dtype)
    slot_mapping = torch.full((num_tokens,), -1, dtype=torch.int64, device=device)
    full_kv, used, start = [], 0, 0
    for b, (ctx, n) in enumerate(batch):
        nblk = -(-(ctx + n) // BS)
        ids = perm[used : used + nblk].long()
        used += nblk
        block_tables[b, :nblk] = ids.int()
        pos = torch.arange(ctx + n, device=device)
        slots = ids[pos // BS] * BS + pos % BS
        pk = torch.randn(ctx, HK, D, device=device, dtype=dtype)
        pv = torch.randn(ctx, HK, D, device=device, dtype=dtype)
        reshape_and_cache_torch(pk, pv, k_cache, v_cache, slots[:ctx], scale, scale)
        slot_mapping[start : start + n] = slots[ctx:]
        deq = 1.0 if scale is None else scale  # the prefix as the cache holds it
        rows = slots[:ctx]
        kf = torch.cat((k_cache.view(-1, HK, D)[rows].float() * deq, k[start : start + n].float()))
        vf = torch.cat((v_cache.view(-1, HK, D)[rows].float() * deq, v[start : start + n].float()))
        full_kv.append((kf, vf))
        start += n
    seq_lens = [c + n for c, n in batch]
    meta = AttentionMetadata(
        num_reqs=len(batch), num_tokens=num_tokens,
        query_start_loc=torch.tensor([0, *qlens], device=device).cumsum(0).to(torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        context_lens=torch.tensor([c for c, _ in batch], dtype=torch.int32, device=device),
        block_tables=block_tables, slot_mapping=slot_mapping,
        max_query_len=max(qlens), max_seq_len=max(seq_lens),
        query_lens_cpu=qlens, seq_lens_cpu=seq_lens, context_lens_cpu=[c for c, _ in batch],
    )
    return q, k, v, k_cache, v_cache, meta, full_kv


def _torch_attention(q, meta, full_kv, scale):
    """Plain causal SDPA per request over prefix + new keys, float32, GQA by repeating KV heads."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    qsl = meta.query_start_loc.tolist()
    for b, (kf, vf) in enumerate(full_kv):
        s, e, ctx = qsl[b], qsl[b + 1], meta.context_lens_cpu[b]
        qb = q[s:e].float().transpose(0, 1)  # (Hq, n, D)
        kb = kf.repeat_interleave(HQ // HK, dim=1).transpose(0, 1)  # (Hq, ctx + n, D)
        vb = vf.repeat_interleave(HQ // HK, dim=1).transpose(0, 1)
        visible = torch.arange(ctx + e - s, device=q.device)[None, :] <= (ctx + torch.arange(e - s, device=q.device))[:, None]
        out[s:e] = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=visible, scale=scale).transpose(0, 1)
    return out


@pytest.mark.parametrize(("dtype", "cache_dtype", "kv_scale"), [
    (torch.float16, torch.float16, None),
    (torch.bfloat16, torch.bfloat16, None),
    (torch.bfloat16, torch.float8_e4m3fn, 0.05),
])
def test_mixed_batch(device, assert_close, dtype, cache_dtype, kv_scale):
    # decode, prefill over a cached prefix (not block aligned), fresh prefill, decode
    batch = [(30, 1), (17, 12), (0, 9), (5, 1)]
    q, k, v, k_cache, v_cache, meta, full_kv = _setup(device, batch, dtype, cache_dtype, scale=kv_scale)
    backend = TritonAttentionBackend() if kv_scale is None else TritonAttentionBackend(kv_scale, kv_scale)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, D**-0.5)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, _torch_attention(q, meta, full_kv, D**-0.5), dtype, "attention")
    # the new tokens landed in the cache
    ref_k, ref_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    reshape_and_cache_torch(k, v, ref_k, ref_v, meta.slot_mapping, kv_scale, kv_scale)
    written = meta.slot_mapping[meta.slot_mapping >= 0]
    assert torch.equal(k_cache.view(-1, HK, D)[written].float(), ref_k.view(-1, HK, D)[written].float())


def test_decode_only_batch_with_padding(device, assert_close):
    batch = [(40, 1), (0, 1), (16, 1)]
    q, k, v, k_cache, v_cache, meta, full_kv = _setup(device, batch, torch.float16, torch.float16, num_padding=2)
    assert meta.is_decode_only
    out = TritonAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, D**-0.5)
    assert_close(out[:3], _torch_attention(q, meta, full_kv, D**-0.5)[:3], torch.float16, "attention")
    assert bool((out[3:] == 0).all())  # padding rows


def test_prefill_with_padding_rows(device, assert_close):
    batch = [(3, 5), (0, 2)]
    q, k, v, k_cache, v_cache, meta, full_kv = _setup(device, batch, torch.float32, torch.float32, num_padding=3)
    out = TritonAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, D**-0.5)
    assert_close(out[:7], _torch_attention(q, meta, full_kv, D**-0.5)[:7], torch.float32, "attention")
    assert bool((out[7:] == 0).all())
