"""Fused MoE experts: the Triton grouped GEMMs and the torch grouped path against a per-token
reference; the grouped torch path runs each expert's GEMMs once, not once per token."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdcluster.kernels import fused_moe as fm
from pdcluster.kernels.moe_router import moe_router_torch


def per_token_reference(hidden, w13, w2, weights, ids):
    """The definition, one (token, slot) at a time, in float32."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for t in range(hidden.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e].float() @ hidden[t].float()).chunk(2)
            out[t] += float(weights[t, j]) * (w2[e].float() @ (F.silu(gate) * up))
    return out


def make_case(num_tokens, num_experts, top_k, hidden, inter, dtype, device):
    x = torch.randn(num_tokens, hidden, device=device).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, device=device) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, device=device) / inter**0.5).to(dtype)
    weights, ids = moe_router_torch(torch.randn(num_tokens, num_experts, device=device), top_k)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "hidden", "inter"),
                         [(1, 4, 2, 32, 16), (7, 8, 2, 48, 40), (33, 5, 3, 16, 24), (3, 6, 6, 32, 32)])
def test_fused_moe_triton_matches_reference(device, assert_close, num_tokens, num_experts, top_k, hidden, inter,
                                            dtype):
    x, w13, w2, weights, ids = make_case(num_tokens, num_experts, top_k, hidden, inter, dtype, device)
    got = fm.fused_moe_triton(x, w13, w2, weights, ids)
    ref = fm.fused_moe_torch(x, w13, w2, weights, ids)
    assert got.dtype == dtype and got.shape == x.shape
    assert_close(got, ref, dtype, "attention")  # sums of products: attention's tolerance


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k"), [(1, 4, 2), (9, 8, 3), (40, 3, 1), (5, 6, 6)])
def test_grouped_torch_path_matches_per_token(num_tokens, num_experts, top_k):
    x, w13, w2, weights, ids = make_case(num_tokens, num_experts, top_k, 24, 20, torch.float32, "cpu")
    torch.testing.assert_close(fm.fused_moe_torch(x, w13, w2, weights, ids),
                               per_token_reference(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


def test_grouped_torch_path_runs_each_expert_once(monkeypatch):
    x, w13, w2, weights, ids = make_case(64, 4, 2, 16, 8, torch.float32, "cpu")
    calls = []
    real = F.linear
    monkeypatch.setattr(fm.F, "linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    fm.fused_moe_torch(x, w13, w2, weights, ids)
    used = len(set(ids.flatten().tolist()))
    assert len(calls) == 2 * used and sum(calls) == 2 * 64 * 2  # two GEMMs per used expert, all rows


def test_align_pairs_blocks_never_mix_experts():
    ids = torch.tensor([[3, 0], [0, 1], [3, 0], [2, 3]], dtype=torch.int32)
    pairs, experts = fm.align_pairs(ids, num_experts=5, block_m=2)
    flat = ids.flatten().tolist()
    # expert 0: 3 pairs -> 2 blocks; 4 unused: none; then surplus blocks (expert -1, no pairs) up to
    # the sync-free bound cdiv(8, 2) + min(5, 8) = 9
    assert experts.tolist() == [0, 0, 1, 2, 3, 3, -1, -1, -1]
    blocks = pairs.view(-1, 2).tolist()
    for expert, block in zip(experts.tolist(), blocks):
        assert all(flat[p] == expert for p in block if p >= 0)
        assert expert >= 0 or block == [-1, -1]
    assert sorted(p for p in pairs.tolist() if p >= 0) == list(range(8))


def test_empty_and_errors(device):
    x, w13, w2, weights, ids = make_case(0, 4, 2, 16, 8, torch.float32, device)
    assert fm.fused_moe_triton(x, w13, w2, weights, ids).shape == (0, 16)
    with pytest.raises(ValueError, match="w2"):
        fm.fused_moe_torch(x, w13, w2[:, :, :4], weights, ids)
