"""The experts of one MoE layer, stacked per layer and sharded like the dense MLP under TP.

    w13_weight (E, 2 * I/t, H):  expert e's rows [gate slice of rank | up slice of rank]
    w2_weight  (E, H, I/t):      expert e's down_proj columns of rank

Every expert lives on every rank with 1/t of its intermediate dimension (column parallel gate/up,
row parallel down), so each rank's output is a partial sum and one all-reduce (the dense MLP's,
RowParallelLinear) completes it: TP=t computes what TP=1 does.

Expert parallel (`expert_parallel`, EngineArgs.enable_expert_parallel): rank r holds the whole of
experts [r*E//t, (r+1)*E//t) instead (E_r of them: w13 (E_r, 2I, H), w2 (E_r, H, I)). Every rank
has every token's hidden state already (attention ends in an all-reduce), so no all-to-all is
needed: each rank runs its experts' (token, slot) pairs (the others' become id -1, skipped) and
the same one all-reduce sums the ranks' partial outputs. Fewer, larger GEMMs per rank and no
intermediate-dimension split; the routing is computed on every rank (replicated gate).

Checkpoints store each expert as
separate gate/up/down tensors; the loader hands them in with shard_id (expert, part), part 0 =
gate, 1 = up, 2 = down (see EXPERT_PARTS).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from pdcluster.kernels.ops import Ops
from pdcluster.models.layers.weight_slice import Loaded, narrow, shape_of

if TYPE_CHECKING:
    from pdcluster.distributed.comm import TPComm

# checkpoint name of an expert's projection -> part (Qwen-MoE names, then Mixtral's w1/w3/w2)
EXPERT_PARTS: dict[str, int] = {"gate_proj": 0, "up_proj": 1, "down_proj": 2, "w1": 0, "w3": 1, "w2": 2}


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype, ops: Ops,
                 tp_rank: int = 0, tp_size: int = 1, expert_parallel: bool = False) -> None:
        super().__init__()
        self.expert_parallel = expert_parallel and tp_size > 1
        if self.expert_parallel and num_experts < tp_size:
            raise ValueError(f"expert parallel needs at least one expert per rank: num_experts={num_experts} < "
                             f"tensor_parallel_size={tp_size}")
        if not self.expert_parallel and intermediate_size % tp_size:
            raise ValueError(f"moe_intermediate_size ({intermediate_size}) is not divisible by "
                             f"tensor_parallel_size ({tp_size})")
        self.num_experts, self.hidden_size = num_experts, hidden_size
        # This rank's experts [first, last) and the share of each one's intermediate dim it holds.
        self.first_expert, self.last_expert = 0, num_experts
        self.inter_local, self.inter_shard = intermediate_size // tp_size, tp_rank
        if self.expert_parallel:
            self.first_expert, self.last_expert = tp_rank * num_experts // tp_size, (tp_rank + 1) * num_experts // tp_size
            self.inter_local, self.inter_shard = intermediate_size, 0
        self.inter_full = intermediate_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self._ops = ops
        local = self.last_expert - self.first_expert
        self.w13_weight = nn.Parameter(torch.empty(local, 2 * self.inter_local, hidden_size, dtype=dtype),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(local, hidden_size, self.inter_local, dtype=dtype),
                                      requires_grad=False)
        for param, parts in ((self.w13_weight, (0, 1)), (self.w2_weight, (2,))):
            param.weight_loader = self.weight_loader
            # What the loader must have filled before the model may run (named when missing).
            param.required_shards = [(e, p) for e in range(self.first_expert, self.last_expert) for p in parts]
        # The TP communication hook (see RowParallelLinear); set by pdcluster.distributed.
        self.tp_group: TPComm | None = None

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: str | int | tuple | None = None) -> None:
        if not isinstance(shard_id, tuple) or len(shard_id) != 2:
            raise ValueError(f"expert weights need shard_id (expert, part), got {shard_id!r}")
        expert, part = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"checkpoint has expert {expert}, the config says num_experts={self.num_experts}")
        inter, full = self.inter_local, self.inter_full
        want = (full, self.hidden_size) if part < 2 else (self.hidden_size, full)
        if shape_of(loaded) != want:
            raise ValueError(f"expert {expert} part {part} has shape {shape_of(loaded)}, expected {want}")
        if not self.first_expert <= expert < self.last_expert:
            return  # another rank's expert (expert parallel): never read
        local = expert - self.first_expert
        if part < 2:  # gate / up: this rank's rows
            dst = param.data[local].narrow(0, part * inter, inter)
            dst.copy_(narrow(loaded, 0, self.inter_shard * inter, inter))
        else:  # down: this rank's columns
            param.data[local].copy_(narrow(loaded, 1, self.inter_shard * inter, inter))

    def forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """hidden (T, H), topk_weights / topk_ids (T, k) -> (T, H), summed over the TP ranks."""
        if self.expert_parallel:  # global expert ids -> this rank's, -1 for another rank's
            local = topk_ids - self.first_expert
            topk_ids = local.masked_fill((local < 0) | (local >= self.last_expert - self.first_expert), -1)
        out = self._ops.fused_moe(hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        if self.tp_size > 1:
            if self.tp_group is None:
                raise RuntimeError("FusedMoE with tp_size > 1 needs tp_group set before forward")
            self.tp_group.all_reduce(out)
        return out
