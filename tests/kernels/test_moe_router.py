"""MoE router (softmax / sigmoid, top-k, renormalisation) against the torch reference."""

from __future__ import annotations

import pytest
import torch

from pdcluster.kernels.moe_router import moe_router_torch, moe_router_triton


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k"), [(1, 8, 2), (5, 60, 4), (64, 16, 1), (3, 7, 7)])
def test_router_matches_reference(device, num_tokens, num_experts, top_k, scoring, renormalize):
    # distinct float32 logits: no ties, so the chosen ids must match exactly
    logits = torch.randn(num_tokens, num_experts, device=device)
    w, ids = moe_router_triton(logits, top_k, scoring, renormalize)
    w_ref, ids_ref = moe_router_torch(logits, top_k, scoring, renormalize)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32 and w.shape == (num_tokens, top_k)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-5)


def test_bf16_logits_with_ties(device):
    # bfloat16 logits collide often; any order among equal scores is fine, the weights are not.
    logits = torch.randn(16, 32, device=device).to(torch.bfloat16)
    w, ids = moe_router_triton(logits, 6, "sigmoid", renormalize=False)
    w_ref, _ = moe_router_torch(logits, 6, "sigmoid", renormalize=False)
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-5)
    scores = logits.float().sigmoid()
    torch.testing.assert_close(scores.gather(1, ids.long()), w, atol=1e-6, rtol=1e-5)
    assert all(len(set(row)) == 6 for row in ids.tolist())


def test_empty_and_errors(device):
    w, ids = moe_router_triton(torch.randn(0, 8, device=device), 2)
    assert w.shape == ids.shape == (0, 2)
    with pytest.raises(ValueError, match="top_k"):
        moe_router_triton(torch.randn(2, 8, device=device), 9)
    with pytest.raises(ValueError, match="scoring"):
        moe_router_triton(torch.randn(2, 8, device=device), 2, "relu")
    with pytest.raises(ValueError, match="logits"):
        moe_router_triton(torch.randn(8, device=device), 2)
