"""Fused MoE pairs with expert id -1 (expert parallel: another rank's expert) add nothing, on the
torch grouped path and the Triton grouped GEMMs: the same as those pairs' weights set to 0."""

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


def make_case(num_tokens, num_experts, top_k, hidden, inter, device):
    x = torch.randn(num_tokens, hidden, device=device)
    w13 = torch.randn(num_experts, 2 * inter, hidden, device=device) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, device=device) / inter**0.5
    weights, ids = moe_router_torch(torch.randn(num_tokens, num_experts, device=device), top_k)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k"), [(1, 4, 2), (9, 5, 3), (6, 3, 1)])
def test_minus_one_pairs_add_nothing(device, assert_close, num_tokens: int, num_experts: int, top_k: int) -> None:
    x, w13, w2, weights, ids = make_case(num_tokens, num_experts, top_k, 32, 16, device)
    skip = (ids % 2 == 1)  # odd experts live on "another rank"
    skip[0, 0] = True
    want = per_token_reference(x, w13, w2, weights.masked_fill(skip, 0), ids)
    ids_local = ids.masked_fill(skip, -1)
    assert_close(fm.fused_moe_torch(x, w13, w2, weights, ids_local), want, torch.float32)
    assert_close(fm.fused_moe_triton(x, w13, w2, weights, ids_local), want, torch.float32)
    order, counts = fm.group_by_expert(ids_local, num_experts)
    assert order.numel() == sum(counts) == int((~skip).sum())  # skipped pairs are never computed
