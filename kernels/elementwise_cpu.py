"""RMSNorm, fused add + RMSNorm, rotary embedding and SiLU-and-mul on the CPU through the C
kernels of csrc/elementwise_cpu.c: one call per op where eager torch makes 3-8 (why: the
docstring there). Same signatures and contracts as the torch references in norm.py, rotary.py
and activation.py, which each function falls back to (and is tested against) wherever the kernel
does not apply: not float32, not on the CPU, a last dimension that is not contiguous, no compiler
or PDCLUSTER_NATIVE=0, or inside a dynamo trace (the compiled forward fuses these itself, and a
ctypes call cannot enter a graph). A missing kernel is slower, never different in contract.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from . import native
from .activation import silu_and_mul_torch
from .norm import fused_add_rms_norm_torch, rms_norm_torch
from .rotary import rotary_embedding_torch

_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


@functools.cache
def _lib() -> ctypes.CDLL | None:
    lib = native.load("elementwise_cpu")
    if lib is None:
        return None
    lib.pd_rms_norm.argtypes = [_P, _I64, _P, _I64, _P, _P, _I64, _P, _I64, _I64, _I64, _F, _INT]
    lib.pd_rotary.argtypes = [_P, _P, _I64, _I64, _I64, _I64, _I64, _P, _I64, _INT, _INT]
    lib.pd_silu_and_mul.argtypes = [_P, _I64, _P, _I64, _I64, _I64, _INT]
    for f in (lib.pd_rms_norm, lib.pd_rotary, lib.pd_silu_and_mul):
        f.restype = ctypes.c_int
    return lib


def available() -> bool:
    return _lib() is not None


# The checks below are deliberately cheap attribute reads (no device objects, no views, no
# generator expressions): at decode sizes the kernel runs in ~2 us, and Python around it is
# what these functions exist to save.
_F32 = torch.float32


def _native() -> ctypes.CDLL | None:
    """The library, or None inside a dynamo trace (asked first: the trace must not even reach
    the loader, whose lock dynamo cannot enter) or where it is not built."""
    return None if torch.compiler.is_dynamo_compiling() else _lib()


def _rows_ok(x: torch.Tensor) -> bool:
    """A float32 CPU (rows, last) tensor with a contiguous last dimension."""
    return x.dtype is _F32 and x.is_cpu and x.dim() == 2 and (x.stride(1) == 1 or x.shape[1] == 1)


def _vector_ok(w: torch.Tensor, n: int) -> bool:
    return w.dtype is _F32 and w.is_cpu and w.dim() == 1 and w.shape[0] == n and w.is_contiguous()


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: (T, H), weight: (H,) -> (T, H)."""
    lib = _native()
    if lib is None or not _rows_ok(x) or not _vector_ok(weight, x.shape[1]):
        return rms_norm_torch(x, weight, eps)
    t, h = x.shape
    out = torch.empty((t, h), dtype=_F32)
    if lib.pd_rms_norm(x.data_ptr(), x.stride(0), None, 0, weight.data_ptr(), out.data_ptr(), h, None, 0, t, h, eps,
                       torch.get_num_threads()):
        return rms_norm_torch(x, weight, eps)
    return out


def fused_add_rms_norm_cpu(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual)."""
    lib = _native()
    if (lib is None or not _rows_ok(x) or not _rows_ok(residual) or residual.shape != x.shape
            or not _vector_ok(weight, x.shape[1])):
        return fused_add_rms_norm_torch(x, residual, weight, eps)
    t, h = x.shape
    out = torch.empty((t, h), dtype=_F32)
    res_out = torch.empty((t, h), dtype=_F32)
    if lib.pd_rms_norm(x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0), weight.data_ptr(),
                       out.data_ptr(), h, res_out.data_ptr(), h, t, h, eps, torch.get_num_threads()):
        return fused_add_rms_norm_torch(x, residual, weight, eps)
    return out, res_out


def _rotate_in_place(lib: ctypes.CDLL, positions: torch.Tensor, t: torch.Tensor, cos_sin_cache: torch.Tensor,
                     is_neox: bool) -> bool:
    """Rotate t (T, H, D) in place; False (nothing written) where the kernel does not take it."""
    if t.dtype is not _F32 or not t.is_cpu or t.dim() != 3 or t.stride(2) != 1:
        return False
    return lib.pd_rotary(positions.data_ptr(), t.data_ptr(), t.stride(0), t.stride(1), t.shape[0], t.shape[1],
                         cos_sin_cache.shape[1], cos_sin_cache.data_ptr(), cos_sin_cache.shape[0], int(is_neox),
                         torch.get_num_threads()) == 0


def rotary_embedding_cpu(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                         is_neox: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: (T,) int; q: (T, Hq, D); k: (T, Hk, D) (may be empty). Rotates in place. A
    position outside the cache is refused by the kernel before it writes, and the reference then
    raises its IndexError."""
    lib = _native()
    if (lib is not None and cos_sin_cache.dtype is _F32 and cos_sin_cache.is_cpu and cos_sin_cache.dim() == 2
            and cos_sin_cache.is_contiguous() and cos_sin_cache.shape[1] <= q.shape[-1] and positions.is_cpu
            and positions.dim() == 1 and positions.shape[0] == q.shape[0]):
        pos = positions if positions.dtype is torch.int64 and positions.is_contiguous() else \
            positions.to(torch.int64).contiguous()
        if _rotate_in_place(lib, pos, q, cos_sin_cache, is_neox):
            if not k.numel() or _rotate_in_place(lib, pos, k, cos_sin_cache, is_neox):
                return q, k
            rotary_embedding_torch(positions, q[:, :0], k, cos_sin_cache, is_neox)  # k only: q is done
            return q, k
    return rotary_embedding_torch(positions, q, k, cos_sin_cache, is_neox)


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:
    """x: (T, 2I) with the gate in the first half -> (T, I)."""
    lib = _native()
    if lib is None or not _rows_ok(x) or x.shape[1] % 2:
        return silu_and_mul_torch(x)
    t, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((t, inter), dtype=_F32)
    if lib.pd_silu_and_mul(x.data_ptr(), x.stride(0), out.data_ptr(), inter, t, inter, torch.get_num_threads()):
        return silu_and_mul_torch(x)
    return out
