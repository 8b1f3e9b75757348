"""Fused MoE experts: every token through its top-k experts' gated MLPs, weighted and summed.

    hidden (T, H), w13 (E, 2I, H) = [gate | up] per expert, w2 (E, H, I),
    topk_weights (T, k) float32 (or the model dtype), topk_ids (T, k) int
    -> out (T, H) in hidden's dtype:  out[t] = sum_j w[t, j] * w2[e] @ (silu(gate_e x) * up_e x),  e = ids[t, j]
    An id of -1 is a pair this call does not compute (expert parallel: another rank's expert); it adds 0.

The Triton version runs the same grouping as two grouped GEMM launches (see its section).

The torch version is grouped, not a loop over tokens: the T*k (token, expert) pairs are sorted by
expert once, each expert with tokens runs its two GEMMs once on its contiguous group, and one
index_add_ scatters the weighted rows back. Rows are added in expert order, the order transformers'
experts loop adds them in, so float32 results agree with transformers to the last bit in practice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ._checks import FLOAT_DTYPES, cdiv, check_tensor, next_power_of_2
from ._jit import is_interpreted, lazy_jit

if TYPE_CHECKING:
    import triton.language as tl


def check_moe_args(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor) -> None:
    check_tensor("hidden", hidden, ndim=2, dtypes=FLOAT_DTYPES)
    num_tokens, hidden_size = hidden.shape
    check_tensor("w13", w13, ndim=3, dtypes=(hidden.dtype,), device=hidden.device)
    num_experts, two_inter, _ = w13.shape
    if two_inter % 2 or w13.shape[2] != hidden_size:
        raise ValueError(f"w13: shape {tuple(w13.shape)} must be (E, 2I, H={hidden_size})")
    check_tensor("w2", w2, shape=(num_experts, hidden_size, two_inter // 2), dtypes=(hidden.dtype,),
                 device=hidden.device)
    check_tensor("topk_ids", topk_ids, shape=(num_tokens, None), device=hidden.device)
    check_tensor("topk_weights", topk_weights, shape=tuple(topk_ids.shape), device=hidden.device)


def group_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """-> (order, counts): order sorts the flattened (token, slot) pairs by expert (stable, so tokens
    ascend inside a group); counts[e] pairs go to expert e (one host sync for the split). Pairs with
    id -1 (not computed here) sort first and are left out of order."""
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat + 1, minlength=num_experts + 1).tolist()
    return order[counts[0]:], counts[1:]


def fused_moe_torch(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor) -> torch.Tensor:
    """Reference and CPU path: (T, H) in hidden's dtype (see the module doc)."""
    check_moe_args(hidden, w13, w2, topk_weights, topk_ids)
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros_like(hidden)
    if num_tokens == 0:
        return out
    order, counts = group_by_expert(topk_ids, w13.shape[0])
    tokens = order // top_k  # (T*k,): the token of each sorted pair
    grouped = hidden[tokens]  # (T*k, H), expert 0's rows first
    expert_out = torch.empty_like(grouped)
    start = 0
    for expert, count in enumerate(counts):  # a loop over experts, each GEMM on its whole group
        if count:
            rows = slice(start, start + count)
            gate, up = F.linear(grouped[rows], w13[expert]).chunk(2, dim=-1)
            expert_out[rows] = F.linear(F.silu(gate) * up, w2[expert])
            start += count
    # Weight in the weights' dtype (float32 router weights upcast, as Mixtral does), then add in
    # the model dtype.
    weighted = expert_out * topk_weights.reshape(-1)[order, None]
    out.index_add_(0, tokens, weighted.to(hidden.dtype))
    return out


# ----------------------------------------------------------------------------------------------
# Triton
#
# The sorted (token, slot) pairs are laid out in row blocks of BLOCK_M that never mix experts
# (each expert's group padded up to a multiple of BLOCK_M with -1 entries):
#
#     block_pairs  = [ e0 pairs .. -1 -1 | e1 pairs ... -1 | e3 pairs ... | -1 ...]  block_expert = [0, 1, 3, -1]
#
# Program (m, n) multiplies its row block by expert block_expert[m]'s weight tile n:
#     launch 1:  inter[pair]  = hidden[pair // k] @ w13[e].T            (then silu_and_mul)
#     launch 2:  out_k[pair]  = weight[pair] * act[pair] @ w2[e].T
# and out = out_k.view(T, k, H).sum(1). Experts nobody picked get no program.


@lazy_jit
def _expert_gemm_kernel(
    a_ptr, b_ptr, c_ptr, weight_ptr, pairs_ptr, block_expert_ptr,
    n_out, k_in, stride_am, stride_be, stride_bn, stride_cm,
    A_ROW_DIV: tl.constexpr, WEIGHTED: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + rows).to(tl.int64)
    valid = pair >= 0
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:  # a surplus block of the sync-free layout
        return
    a_row = tl.where(valid, pair // A_ROW_DIV, 0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_in
        a = tl.load(a_ptr + a_row[:, None] * stride_am + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptr + expert * stride_be + cols[None, :] * stride_bn + ks[:, None],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # (BLOCK_K, BLOCK_N) = W[e][cols, ks].T
        if DOT_F32:  # exact float32 products (tf32 would drop 13 mantissa bits)
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    if WEIGHTED:
        acc = acc * tl.load(weight_ptr + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(c_ptr + pair[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=valid[:, None] & col_ok[None, :])


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (block_pairs (num_blocks * block_m,) int32 with -1 padding, block_expert (num_blocks,) int32),
    on topk_ids' device, without a loop or a host sync: num_blocks is the bound cdiv(T*k, block_m) +
    min(E, T*k) (each used expert adds at most one partly filled block); the blocks past the used
    ones hold only -1 pairs and expert -1, and their programs exit at once."""
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    blocks = (counts + block_m - 1) // block_m
    sorted_expert = flat[order]
    group_start = torch.cumsum(counts, 0) - counts
    padded_start = (torch.cumsum(blocks, 0) - blocks) * block_m
    rank = torch.arange(flat.numel(), device=flat.device) - group_start[sorted_expert]
    num_blocks = cdiv(flat.numel(), block_m) + min(num_experts, flat.numel())
    block_pairs = torch.full((num_blocks * block_m,), -1, dtype=torch.int32, device=flat.device)
    block_pairs[padded_start[sorted_expert] + rank] = order.to(torch.int32)
    # block j belongs to the first expert whose cumulative block count exceeds j (num_experts: none)
    block_ends = torch.cumsum(blocks, 0)
    block_expert = torch.searchsorted(block_ends, torch.arange(num_blocks, device=flat.device), right=True)
    return block_pairs, torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, weights: torch.Tensor | None,
                  block_pairs: torch.Tensor, block_expert: torch.Tensor, a_row_div: int, block_m: int) -> None:
    n_out, k_in = w.shape[1], w.shape[2]
    block_n = min(64, max(16, next_power_of_2(n_out)))
    block_k = min(64, max(16, next_power_of_2(k_in)))
    dot_f32 = a.dtype == torch.float32 or (a.dtype == torch.bfloat16 and is_interpreted(_expert_gemm_kernel))
    grid = (block_expert.numel(), cdiv(n_out, block_n))
    _expert_gemm_kernel[grid](
        a, w, out, weights if weights is not None else out, block_pairs, block_expert,
        n_out, k_in, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        A_ROW_DIV=a_row_div, WEIGHTED=weights is not None, DOT_F32=dot_f32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)


def fused_moe_triton(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor) -> torch.Tensor:
    """Same contract as fused_moe_torch (the k expert outputs of a token are summed in slot order)."""
    from .activation import silu_and_mul_triton

    check_moe_args(hidden, w13, w2, topk_weights, topk_ids)
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return torch.zeros_like(hidden)
    hidden, w13, w2 = hidden.contiguous(), w13.contiguous(), w2.contiguous()
    # A -1 pair (another rank's expert) runs on expert 0 with weight 0: no host sync to drop it.
    skip = topk_ids < 0
    topk_ids, topk_weights = topk_ids.clamp(min=0), topk_weights.masked_fill(skip, 0)
    block_m = 16  # tl.dot's minimum; decode batches put only a few pairs on each expert
    block_pairs, block_expert = align_pairs(topk_ids, w13.shape[0], block_m)
    pairs = num_tokens * top_k
    inter = torch.empty((pairs, w13.shape[1]), dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(hidden, w13, inter, None, block_pairs, block_expert, top_k, block_m)
    act = silu_and_mul_triton(inter)  # (pairs, I)
    out_k = torch.empty((pairs, hidden.shape[1]), dtype=torch.float32, device=hidden.device)
    weights = topk_weights.reshape(-1).contiguous()
    _grouped_gemm(act, w2, out_k, weights, block_pairs, block_expert, 1, block_m)
    return out_k.view(num_tokens, top_k, -1).sum(dim=1).to(hidden.dtype)
