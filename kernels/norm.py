"""RMSNorm and fused residual-add + RMSNorm.

Contract (both backends): statistics in float32, output in the input dtype.
`fused_add_rms_norm` returns (normed, residual_out) with residual_out = x + residual; callers use the
returned tensors and must not rely on the inputs being preserved (the Triton launcher works in place).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ._checks import FLOAT_DTYPES, cdiv, check_same, check_tensor, next_power_of_2
from ._jit import lazy_jit

if TYPE_CHECKING:
    import triton.language as tl


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


# ----------------------------------------------------------------------------------------------
# Triton
#
# One program normalises BLOCK_M rows; a row is loaded whole (BLOCK_H >= H), so there is one read
# and one write per element. Small hidden sizes (per-head q/k norm, H = head_dim) pack several rows
# per program so each program still moves a few KiB.
#
#     x (T, H), row stride sx        program p: rows [p*BLOCK_M, (p+1)*BLOCK_M)
#     +-----------------+            tile (BLOCK_M, BLOCK_H), columns >= H masked
#     | row p*BLOCK_M   |
#     | ...             |
#     +-----------------+

_MAX_BLOCK_H = 65536  # one row must fit a program; larger hidden sizes would need a two-pass kernel


@lazy_jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr,
    stride_x, stride_res, stride_out,
    num_rows, hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_H)
    mask = (rows < num_rows)[:, None] & (cols < hidden)[None, :]
    rows = rows.to(tl.int64)  # T * stride can exceed 2**31 for long prefills
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res_ptrs = res_ptr + rows[:, None] * stride_res + cols[None, :]
        r = tl.load(res_ptrs, mask=mask, other=0.0)
        # Round the sum to the model dtype before the statistics, as the reference does.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_ptrs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / hidden + eps)  # (BLOCK_M,)
    # Same two roundings as the reference: normalised value to x.dtype, then times the weight.
    y = (xf * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :],
             (y * w[None, :]).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x2: torch.Tensor, res2: torch.Tensor | None, weight: torch.Tensor, out2: torch.Tensor,
            eps: float) -> None:
    num_rows, hidden = x2.shape
    if num_rows == 0:
        return
    block_h = next_power_of_2(hidden)
    if block_h > _MAX_BLOCK_H:
        raise ValueError(f"x: hidden size {hidden} exceeds the single-pass limit {_MAX_BLOCK_H}")
    block_m = max(1, min(16, 2048 // block_h))  # ~2K+ elements per program
    elems = block_m * block_h
    num_warps = 8 if elems >= 8192 else 4 if elems >= 2048 else 2
    res_arg = res2 if res2 is not None else x2
    _rms_norm_kernel[(cdiv(num_rows, block_m),)](
        x2, res_arg, weight, out2,
        x2.stride(0), res_arg.stride(0), out2.stride(0),
        num_rows, hidden, float(eps),
        HAS_RESIDUAL=res2 is not None, BLOCK_M=block_m, BLOCK_H=block_h, num_warps=num_warps,
    )


def _check(x: torch.Tensor, weight: torch.Tensor) -> int:
    check_tensor("x", x, dtypes=FLOAT_DTYPES, last_dim_contiguous=False)
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension (..., H)")
    hidden = x.shape[-1]
    check_tensor("weight", weight, shape=(hidden,), dtypes=FLOAT_DTYPES, device=x.device)
    return hidden


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: (..., H), weight: (H,) -> new tensor (..., H) in x.dtype."""
    hidden = _check(x, weight)
    x2 = x.reshape(-1, hidden)
    if hidden > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    _launch(x2, None, weight, out, eps)
    return out.view(x.shape)


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: residual <- x + residual, x <- rms_norm(residual); returns (x, residual) viewed
    as the input shapes (a non-viewable input is copied first, so use the returned tensors)."""
    hidden = _check(x, weight)
    check_tensor("residual", residual, dtypes=FLOAT_DTYPES, device=x.device, last_dim_contiguous=False)
    check_same("x.shape, residual.shape", tuple(x.shape), tuple(residual.shape))
    check_same("x.dtype, residual.dtype", x.dtype, residual.dtype)
    x2, r2 = x.reshape(-1, hidden), residual.reshape(-1, hidden)
    if hidden > 1:
        x2 = x2 if x2.stride(1) == 1 else x2.contiguous()
        r2 = r2 if r2.stride(1) == 1 else r2.contiguous()
    _launch(x2, r2, weight, x2, eps)
    return x2.view(x.shape), r2.view(residual.shape)
