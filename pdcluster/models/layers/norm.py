"""RMSNorm module over the ops backend (statistics in float32, output in the input dtype)."""

from __future__ import annotations

import torch
from torch import nn

from pdcluster.kernels.ops import Ops
from pdcluster.models.layers.weight_slice import Loaded, whole


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, ops: Ops) -> None:
        super().__init__()
        self.eps = eps
        self._ops = ops
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = _replicated_loader

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: rms_norm(x). With residual: (rms_norm(x + residual), x + residual),
        the pre-norm transformer's "add the sublayer output, then normalise" in one op."""
        if residual is None:
            return self._ops.rms_norm(x, self.weight, self.eps)
        return self._ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


def _replicated_loader(param: nn.Parameter, loaded: Loaded, shard_id: str | int | None = None) -> None:
    loaded = whole(loaded)
    if param.shape != loaded.shape:
        raise ValueError(f"norm weight has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(loaded)
