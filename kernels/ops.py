"""Backend dispatch for the element-wise / normalisation ops the model layers call.

`get_ops("torch")` returns the torch references; `get_ops("triton")` the Triton launchers (imported
lazily: importing triton is slow and not needed on the CPU path). Both expose the same functions
with the same contracts, documented next to each reference in this package.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Ops:
    name: str
    rms_norm: Callable
    fused_add_rms_norm: Callable
    silu_and_mul: Callable
    rotary_embedding: Callable
    reshape_and_cache: Callable


def get_ops(backend: str) -> Ops:
    if backend == "torch":
        from .activation import silu_and_mul_torch
        from .cache_write import reshape_and_cache_torch
        from .norm import fused_add_rms_norm_torch, rms_norm_torch
        from .rotary import rotary_embedding_torch

        return Ops("torch", rms_norm_torch, fused_add_rms_norm_torch, silu_and_mul_torch,
                   rotary_embedding_torch, reshape_and_cache_torch)
    if backend == "triton":
        from .activation import silu_and_mul_triton
        from .cache_write import reshape_and_cache_triton
        from .norm import fused_add_rms_norm_triton, rms_norm_triton
        from .rotary import rotary_embedding_triton

        return Ops("triton", rms_norm_triton, fused_add_rms_norm_triton, silu_and_mul_triton,
                   rotary_embedding_triton, reshape_and_cache_triton)
    raise ValueError(f"ops backend must be 'torch' or 'triton', got {backend!r}")
