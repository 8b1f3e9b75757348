"""SiLU-and-mul: the gated MLP's activation over the fused gate_up projection."""

from __future__ import annotations

import torch
from torch import nn

from pdcluster.kernels.ops import Ops


class SiluAndMul(nn.Module):
    def __init__(self, ops: Ops) -> None:
        super().__init__()
        self._ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, 2I) = [gate | up] -> silu(gate) * up: (T, I)."""
        return self._ops.silu_and_mul(x)
