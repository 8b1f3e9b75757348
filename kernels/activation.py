"""SiLU-and-mul for gated MLPs: out = silu(x[:, :I]) * x[:, I:]."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """x: (T, 2I) with the gate in the first half -> (T, I) in x.dtype."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
