"""Rotary embedding (NeoX / GPT-J, partial rotary) against the torch reference."""

from __future__ import annotations

import pytest
import torch

from pdcluster.kernels.rotary import rotary_embedding_torch, rotary_embedding_triton


def _cos_sin_cache(max_pos: int, rot: int, device: torch.device) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2, device=device).float() / rot))
    freqs = torch.arange(max_pos, device=device).float()[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # (max_pos, rot)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize(("head_dim", "rot"), [(64, 64), (80, 40), (128, 128), (128, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotary_matches_reference(device, assert_close, dtype, head_dim, rot, is_neox):
    num_tokens, hq, hk = 5, 8, 2
    # q and k as strided views into a fused qkv projection output, as the attention layer has them
    qkv = torch.randn(num_tokens, (hq + 2 * hk) * head_dim, device=device, dtype=dtype)
    q = qkv[:, : hq * head_dim].view(num_tokens, hq, head_dim)
    k = qkv[:, hq * head_dim : (hq + hk) * head_dim].view(num_tokens, hk, head_dim)
    v_before = qkv[:, (hq + hk) * head_dim :].clone()
    positions = torch.tensor([0, 3, 99, 7, 64], device=device)
    cache = _cos_sin_cache(100, rot, device)
    q_ref, k_ref = rotary_embedding_torch(positions, q.clone(), k.clone(), cache, is_neox)
    q_out, k_out = rotary_embedding_triton(positions, q, k, cache, is_neox)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()  # in place
    assert_close(q, q_ref, dtype)
    assert_close(k, k_ref, dtype)
    assert torch.equal(qkv[:, (hq + hk) * head_dim :], v_before)  # neighbours untouched


def test_empty_and_single_token(device, assert_close):
    cache = _cos_sin_cache(16, 64, device)
    q, k = torch.randn(0, 4, 64, device=device), torch.randn(0, 1, 64, device=device)
    rotary_embedding_triton(torch.zeros(0, dtype=torch.int64, device=device), q, k, cache)
    q, k = torch.randn(1, 4, 64, device=device), torch.randn(1, 1, 64, device=device)
    pos = torch.tensor([5], dtype=torch.int32, device=device)
    q_ref, k_ref = rotary_embedding_torch(pos, q.clone(), k.clone(), cache)
    rotary_embedding_triton(pos, q, k, cache)
    assert_close(q, q_ref, torch.float32)
    assert_close(k, k_ref, torch.float32)


def test_argument_errors(device):
    q, k = torch.randn(2, 4, 64, device=device), torch.randn(2, 1, 64, device=device)
    pos = torch.zeros(2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        rotary_embedding_triton(pos, q, k, _cos_sin_cache(8, 128, device))
    with pytest.raises(ValueError, match="positions"):
        rotary_embedding_triton(pos[:1], q, k, _cos_sin_cache(8, 64, device))
    with pytest.raises(ValueError, match="k must have dtype"):
        rotary_embedding_triton(pos, q, k.half(), _cos_sin_cache(8, 64, device))
