"""The gated MLP (SwiGLU): down_proj(silu(gate_proj(x)) * up_proj(x)), gate and up fused.

Column parallel gate_up, row parallel down: one all-reduce per MLP under TP. Dense layers, Qwen2-MoE's
shared expert and the MoE models' dense (mlp_only) layers all use it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pdcluster.kernels.ops import Ops
from pdcluster.models.layers.activation import SiluAndMul
from pdcluster.models.layers.linear import MergedColumnParallelLinear, RowParallelLinear


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype, ops: Ops,
                 tp: dict[str, Any], bias: bool = False) -> None:
        super().__init__()
        # bias (Llama's mlp_bias): gate and up biases fused like their weights; down's added once
        # after the TP reduce (RowParallelLinear).
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias, dtype, **tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, dtype, **tp)
        self.act_fn = SiluAndMul(ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))
