"""SiLU-and-mul for gated MLPs: out = silu(x[:, :I]) * x[:, I:]."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ._checks import FLOAT_DTYPES, cdiv, check_tensor, next_power_of_2
from ._jit import lazy_jit

if TYPE_CHECKING:
    import triton.language as tl


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """x: (T, 2I) with the gate in the first half -> (T, I) in x.dtype."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# ----------------------------------------------------------------------------------------------
# Triton
#
#     x row t:  [ gate 0 .. I-1 | up 0 .. I-1 ]      program (t, j) computes out[t, j*BLOCK : (j+1)*BLOCK]


@lazy_jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, inter, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    # Round silu(gate) to the model dtype before the product, as F.silu(gate) * up does.
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t * stride_out + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """x: (..., 2I) with the gate in the first half -> new tensor (..., I) in x.dtype."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"x: last dimension must be even (gate | up), got shape {tuple(x.shape)}")
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    if x2.shape[0] and inter:
        block = min(next_power_of_2(inter), 2048)
        _silu_and_mul_kernel[(x2.shape[0], cdiv(inter, block))](
            x2, out, x2.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4 if block >= 1024 else 2)
    return out.view(*x.shape[:-1], inter)
