"""Backend dispatch for the element-wise / normalisation ops the model layers call.

`get_ops("torch")` returns the torch path: the references, except that RMSNorm, fused add + RMSNorm,
rotary and SiLU-and-mul run the C kernels of elementwise_cpu.py on float32 CPU tensors outside a
trace (one call per op instead of 3-8; each falls back to its reference wherever the kernel does
not apply); `get_ops("triton")` the Triton launchers (imported
lazily: importing triton is slow and not needed on the CPU path). Both expose the same functions
with the same contracts, documented next to each reference in this package. The backends are one
`Registry` (pdcluster/registry.py) of builders; each builder imports its kernels when called.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pdcluster.registry import Registry


@dataclass(frozen=True)
class Ops:
    name: str
    rms_norm: Callable
    fused_add_rms_norm: Callable
    silu_and_mul: Callable
    rotary_embedding: Callable
    reshape_and_cache: Callable
    moe_router: Callable  # float32 softmax/sigmoid top-k (moe_router.py)
    fused_moe: Callable  # the experts of a MoE layer (fused_moe.py)


def _torch_ops() -> Ops:
    from .cache_write import reshape_and_cache_torch
    from .elementwise_cpu import fused_add_rms_norm_cpu, rms_norm_cpu, rotary_embedding_cpu, silu_and_mul_cpu
    from .fused_moe import fused_moe_torch
    from .moe_router import moe_router_torch

    return Ops("torch", rms_norm_cpu, fused_add_rms_norm_cpu, silu_and_mul_cpu,
               rotary_embedding_cpu, reshape_and_cache_torch, moe_router_torch, fused_moe_torch)


def _triton_ops() -> Ops:
    from .activation import silu_and_mul_triton
    from .cache_write import reshape_and_cache_triton
    from .fused_moe import fused_moe_triton
    from .moe_router import moe_router_triton
    from .norm import fused_add_rms_norm_triton, rms_norm_triton
    from .rotary import rotary_embedding_triton

    return Ops("triton", rms_norm_triton, fused_add_rms_norm_triton, silu_and_mul_triton,
               rotary_embedding_triton, reshape_and_cache_triton, moe_router_triton, fused_moe_triton)


def _ops_builder(obj: object) -> Callable[[], Ops]:
    if not callable(obj):
        raise ValueError("not a callable returning Ops")
    return obj  # type: ignore[return-value]


def _build_registry() -> Registry[Callable[[], Ops]]:
    # Closed set: a backend is a model-runner flag, so no dotted paths or plugins.
    registry: Registry[Callable[[], Ops]] = Registry("ops backend", check=_ops_builder, allow_dotted=False)
    registry.register("torch", _torch_ops)
    registry.register("triton", _triton_ops)
    return registry


OPS_BACKENDS = _build_registry()


def get_ops(backend: str) -> Ops:
    """The op set of `backend` ("torch" | "triton"); ValueError listing the backends."""
    return OPS_BACKENDS.get(backend)()
