"""MoE router: per token, score the experts in float32, keep the top k, optionally renormalise.

    logits (T, E) any float dtype -> weights (T, k) float32, ids (T, k) int32, best expert first

scoring "softmax": weights are softmax(logits) restricted to the top k (Mixtral, Qwen-MoE);
scoring "sigmoid": weights are sigmoid(logits) of the top k (DeepSeek-V3 style, without its
group limits and bias). renormalize divides the k weights by their sum.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ._checks import FLOAT_DTYPES, check_tensor, next_power_of_2
from ._jit import lazy_jit

if TYPE_CHECKING:
    import triton.language as tl

SCORINGS = ("softmax", "sigmoid")


def moe_router_torch(logits: torch.Tensor, top_k: int, scoring: str = "softmax",
                     renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: (weights (T, k) float32, ids (T, k) int32)."""
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    x = logits.float()
    scores = x.softmax(dim=-1) if scoring == "softmax" else x.sigmoid()
    weights, ids = scores.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


# ----------------------------------------------------------------------------------------------
# Triton
#
# One program per token holds all E scores in registers and runs k rounds of "take the max, then
# knock it out". Decode batches have 1-64 tokens, so a launch of T tiny programs beats a sort; the
# k rounds cost k reductions over E <= a few hundred lanes.


@lazy_jit
def _moe_router_kernel(
    logits_ptr, weights_ptr, ids_ptr, stride_t, num_experts,
    TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    valid = e < num_experts
    x = tl.load(logits_ptr + t * stride_t + e, mask=valid, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        scores = tl.sigmoid(x)
    else:
        p = tl.exp(x - tl.max(x, axis=0))
        scores = p / tl.sum(p, axis=0)
    # Scores lie in [0, 1]: padding lanes at -1 and taken experts at -2 can never win a round.
    scores = tl.where(valid, scores, -1.0)
    slot = tl.arange(0, BLOCK_K)
    top_w = tl.zeros([BLOCK_K], tl.float32)
    top_i = tl.zeros([BLOCK_K], tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(scores, axis=0)
        # lowest index among equal maxima, like a stable sort
        idx = tl.min(tl.where(scores == best, e, BLOCK_E), axis=0)
        top_w = tl.where(slot == j, best, top_w)
        top_i = tl.where(slot == j, idx, top_i)
        scores = tl.where(e == idx, -2.0, scores)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=0)  # slots >= TOP_K hold 0 and add nothing
    out = t * TOP_K + slot
    tl.store(weights_ptr + out, top_w, mask=slot < TOP_K)
    tl.store(ids_ptr + out, top_i, mask=slot < TOP_K)


def moe_router_triton(logits: torch.Tensor, top_k: int, scoring: str = "softmax",
                      renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as moe_router_torch."""
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    num_tokens, num_experts = logits.shape
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int in [1, num_experts={num_experts}], got {top_k!r}")
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=logits.device)
    if num_tokens:
        block_e = next_power_of_2(num_experts)
        _moe_router_kernel[(num_tokens,)](
            logits, weights, ids, logits.stride(0), num_experts,
            TOP_K=top_k, BLOCK_E=block_e, BLOCK_K=next_power_of_2(top_k),
            SIGMOID=scoring == "sigmoid", RENORMALIZE=bool(renormalize), num_warps=4 if block_e >= 512 else 1,
        )
    return weights, ids
