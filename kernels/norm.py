"""RMSNorm and fused residual-add + RMSNorm.

Contract (both backends): statistics in float32, output in the input dtype.
`fused_add_rms_norm` returns (normed, residual_out) with residual_out = x + residual; callers use the
returned tensors and must not rely on the inputs being preserved (the Triton launcher works in place).
"""

from __future__ import annotations

import torch


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: (T, H), weight: (H,) -> (T, H) in x.dtype."""
    xf = x.float()
    var = xf.pow(2).mean(dim=-1, keepdim=True)
    return (xf * torch.rsqrt(var + eps)).to(x.dtype) * weight


def fused_add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual); the sum is rounded to x.dtype first, as
    transformers does (`hidden_states = residual + hidden_states` in the model dtype)."""
    residual_out = x + residual
    return rms_norm_torch(residual_out, weight, eps), residual_out
