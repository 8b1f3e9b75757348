"""Every decoder layer of a decode step in one C call (csrc/decode_step_cpu.c): the ctypes
structures the kernel reads and the call itself. Which models and steps may take it, and how the
descriptors are filled from a model, is models/cpu_decode_step.py.

The kernel calls the same C kernels the eager layers call (gemv_bf16_cpu, elementwise_cpu,
paged_decode_cpu), through the function pointers `kernel_pointers` takes from their loaded
libraries, so each kernel has one definition and the step is bit for bit the eager one.
"""

from __future__ import annotations

import ctypes
import functools

from . import elementwise_cpu, gemv_bf16_cpu, native, paged_decode_cpu

_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class LayerDesc(ctypes.Structure):
    """pd_layer: one decoder layer's weights (pointers into tensors the model keeps alive)."""

    _fields_ = [("ln1", _P), ("ln2", _P), ("qkv", _P), ("o", _P), ("gate_up", _P), ("down", _P),
                ("qkv_bias", _P), ("o_bias", _P), ("gate_up_bias", _P), ("down_bias", _P), ("q_norm", _P),
                ("k_norm", _P), ("k_cache", _P), ("v_cache", _P), ("window", _I64), ("rotary", _I64)]


class ModelDesc(ctypes.Structure):
    """pd_model: the shapes every layer shares, the rope table, the final norm, the kernels."""

    _fields_ = [("hidden", _I64), ("inter", _I64), ("hq", _I64), ("hk", _I64), ("d", _I64),
                ("n_layers", _I64), ("block_size", _I64), ("cache_dtype", _I64), ("rot", _I64),
                ("max_pos", _I64), ("neox", _I64), ("bf16", _I64), ("eps", _F), ("scale", _F), ("res_mult", _F),
                ("cos_sin", _P),
                ("final_ln", _P), ("gemv", _P), ("rms", _P), ("rotary", _P), ("silu", _P), ("paged", _P)]


@functools.cache
def _lib() -> ctypes.CDLL | None:
    lib = native.load("decode_step_cpu")
    if lib is None:
        return None
    lib.pd_decode_layers.argtypes = [ctypes.POINTER(ModelDesc), ctypes.POINTER(LayerDesc), _P, _I64, _P, _P, _P,
                                     _I64, _P, _P, ctypes.c_int]
    lib.pd_decode_layers.restype = ctypes.c_int
    lib.pd_decode_scratch_floats.argtypes = [ctypes.POINTER(ModelDesc), _I64]
    lib.pd_decode_scratch_floats.restype = _I64
    return lib


def _address(fn: object) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value or 0


@functools.cache
def kernel_pointers(layout: str = gemv_bf16_cpu.TILES) -> dict[str, int] | None:
    """The addresses of the five kernels the step calls, or None when any library is missing.
    layout: the weights' decode copies' (gemv_bf16_cpu.TILES or PAIRS), which picks the product."""
    gemv, ew, paged = gemv_bf16_cpu.product_fn(layout), elementwise_cpu._lib(), paged_decode_cpu._fn()
    if _lib() is None or gemv is None or ew is None or paged is None:
        return None
    return {"gemv": _address(gemv), "rms": _address(ew.pd_rms_norm), "rotary": _address(ew.pd_rotary),
            "silu": _address(ew.pd_silu_and_mul), "paged": _address(paged)}


def available() -> bool:
    return kernel_pointers() is not None


def scratch_floats(model: ModelDesc, rows: int) -> int:
    lib = _lib()
    assert lib is not None
    return int(lib.pd_decode_scratch_floats(ctypes.byref(model), rows))


def run(model: ModelDesc, layers: ctypes.Array, hidden_ptr: int, rows: int, positions_ptr: int, slots_ptr: int,
        tables_ptr: int, table_stride: int, seq_lens_ptr: int, scratch_ptr: int, threads: int) -> int:
    """pd_decode_layers: 0, or the first failing kernel's code."""
    lib = _lib()
    assert lib is not None
    return int(lib.pd_decode_layers(ctypes.byref(model), layers, hidden_ptr, rows, positions_ptr, slots_ptr,
                                    tables_ptr, table_stride, seq_lens_ptr, scratch_ptr, threads))
