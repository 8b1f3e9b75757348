"""RMSNorm, fused add + RMSNorm, rotary embedding and SiLU-and-mul on the CPU through the C
kernels of csrc/elementwise_cpu.c: one call per op where eager torch makes 3-8 (why: the
docstring there). Same signatures and contracts as the torch references in norm.py, rotary.py
and activation.py, which each function falls back to (and is tested against) wherever the kernel
does not apply: not float32 or bfloat16, not on the CPU, a last dimension that is not contiguous,
no compiler or PDCLUSTER_NATIVE=0, or inside a dynamo trace (the compiled forward fuses these
itself, and a ctypes call cannot enter a graph). A missing kernel is slower, never different in
contract.

bfloat16 tensors (a bf16 model on a CPU that computes in bf16) are widened to float32 (exact), run
through the kernel's bf16 mode, which rounds where the torch reference's bfloat16 ops round, and
narrowed back (exact: the kernel's results are bfloat16 values). The one-call decode step
(models/cpu_decode_step.py) runs the same kernels in the same mode, so its bf16 step is bit for bit
this eager one.
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
    lib.pd_rms_norm.argtypes = [_P, _I64, _P, _I64, _P, _P, _I64, _P, _I64, _I64, _I64, _F, _INT, _INT]
    lib.pd_rotary.argtypes = [_P, _P, _I64, _I64, _I64, _I64, _I64, _P, _I64, _INT, _INT, _INT]
    lib.pd_silu_and_mul.argtypes = [_P, _I64, _P, _I64, _I64, _I64, _INT, _INT]
    for f in (lib.pd_rms_norm, lib.pd_rotary, lib.pd_silu_and_mul):
        f.restype = ctypes.c_int
    return lib


def available() -> bool:
    return _lib() is not None


# The checks below are deliberately cheap attribute reads (no device objects, no views, no
# generator expressions): at decode sizes the kernel runs in ~2 us, and Python around it is
# what these functions exist to save.
_F32, _BF16 = torch.float32, torch.bfloat16


def _native() -> ctypes.CDLL | None:
    """The library, or None inside a dynamo trace (asked first: the trace must not even reach
    the loader, whose lock dynamo cannot enter) or where it is not built."""
    return None if torch.compiler.is_dynamo_compiling() else _lib()


def _rows_ok(x: torch.Tensor) -> bool:
    """A float32 or bfloat16 CPU (rows, last) tensor with a contiguous last dimension."""
    return (x.dtype is _F32 or x.dtype is _BF16) and x.is_cpu and x.dim() == 2 and (x.stride(1) == 1 or x.shape[1] == 1)


def _vector_ok(w: torch.Tensor, x: torch.Tensor) -> bool:
    """The weight of x's rows: x's own dtype (a float32 weight on bf16 rows promotes in the
    reference, which the kernel's bf16 mode does not), one value per column."""
    return w.dtype is x.dtype and w.is_cpu and w.dim() == 1 and w.shape[0] == x.shape[1] and w.is_contiguous()


def _wide(x: torch.Tensor) -> torch.Tensor:
    """x as float32 (a copy, exact, for bfloat16; x itself otherwise)."""
    return x if x.dtype is _F32 else x.float()


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: (T, H), weight: (H,) -> (T, H)."""
    lib = _native()
    if lib is None or not _rows_ok(x) or not _vector_ok(weight, x):
        return rms_norm_torch(x, weight, eps)
    t, h = x.shape
    xf, wf, bf16 = _wide(x), _wide(weight), x.dtype is _BF16
    out = torch.empty((t, h), dtype=_F32)
    if lib.pd_rms_norm(xf.data_ptr(), xf.stride(0), None, 0, wf.data_ptr(), out.data_ptr(), h, None, 0, t, h, eps,
                       int(bf16), torch.get_num_threads()):
        return rms_norm_torch(x, weight, eps)
    return out.to(_BF16) if bf16 else out


def fused_add_rms_norm_cpu(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual)."""
    lib = _native()
    if (lib is None or not _rows_ok(x) or not _rows_ok(residual) or residual.shape != x.shape
            or residual.dtype is not x.dtype or not _vector_ok(weight, x)):
        return fused_add_rms_norm_torch(x, residual, weight, eps)
    t, h = x.shape
    xf, rf, wf, bf16 = _wide(x), _wide(residual), _wide(weight), x.dtype is _BF16
    out = torch.empty((t, h), dtype=_F32)
    res_out = torch.empty((t, h), dtype=_F32)
    if lib.pd_rms_norm(xf.data_ptr(), xf.stride(0), rf.data_ptr(), rf.stride(0), wf.data_ptr(),
                       out.data_ptr(), h, res_out.data_ptr(), h, t, h, eps, int(bf16), torch.get_num_threads()):
        return fused_add_rms_norm_torch(x, residual, weight, eps)
    return (out.to(_BF16), res_out.to(_BF16)) if bf16 else (out, res_out)


def _rotate_in_place(lib: ctypes.CDLL, positions: torch.Tensor, t: torch.Tensor, cos_sin_cache: torch.Tensor,
                     is_neox: bool) -> bool:
    """Rotate t (T, H, D) in place; False (nothing written) where the kernel does not take it."""
    if (t.dtype is not _F32 and t.dtype is not _BF16) or not t.is_cpu or t.dim() != 3 or t.stride(2) != 1:
        return False
    bf16 = t.dtype is _BF16
    tf = t.float() if bf16 else t  # contiguous when widened
    if lib.pd_rotary(positions.data_ptr(), tf.data_ptr(), tf.stride(0), tf.stride(1), tf.shape[0], tf.shape[1],
                     cos_sin_cache.shape[1], cos_sin_cache.data_ptr(), cos_sin_cache.shape[0], int(is_neox), int(bf16),
                     torch.get_num_threads()) != 0:
        return False
    if bf16:
        t.copy_(tf)  # exact: the kernel rounded every rotated value to a bfloat16
    return True


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
    xf, bf16 = _wide(x), x.dtype is _BF16
    out = torch.empty((t, inter), dtype=_F32)
    if lib.pd_silu_and_mul(xf.data_ptr(), xf.stride(0), out.data_ptr(), inter, t, inter, int(bf16),
                           torch.get_num_threads()):
        return silu_and_mul_torch(x)
    return out.to(_BF16) if bf16 else out
