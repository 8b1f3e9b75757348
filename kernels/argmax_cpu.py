"""Greedy sampling's argmax on the CPU through csrc/argmax_cpu.c: torch.argmax(logits, dim=-1)'s
indices (first maximum; a NaN counts as the maximum), in a fraction of its time at vocabulary
sizes (why: the C file). `argmax_rows` returns None where the kernel does not apply (not a 2-D
float32 CPU tensor with a contiguous last dimension, an empty vocabulary, no compiler or
PDCLUSTER_NATIVE=0, inside a dynamo trace): the caller then runs torch.argmax, so a missing
kernel is slower, never different.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from . import native


@functools.cache
def _fn() -> ctypes._CFuncPtr | None:
    lib = native.load("argmax_cpu")
    if lib is None:
        return None
    f = lib.pd_argmax_rows
    f.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    f.restype = ctypes.c_int
    return f


def argmax_rows(x: torch.Tensor) -> torch.Tensor | None:
    """x (rows, n) float32 on the CPU -> (rows,) int64 indices, or None (module docstring)."""
    if (x.dtype is not torch.float32 or not x.is_cpu or x.dim() != 2 or x.shape[1] < 1
            or (x.stride(1) != 1 and x.shape[1] > 1) or torch.compiler.is_dynamo_compiling()):
        return None
    fn = _fn()
    if fn is None:
        return None
    rows, n = x.shape
    out = torch.empty(rows, dtype=torch.int64)
    if rows and fn(x.data_ptr(), max(x.stride(0), n), rows, n, out.data_ptr(), torch.get_num_threads()) != 0:
        return None
    return out
