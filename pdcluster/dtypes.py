"""Dtype names: the one table every layer uses.

Configs, KV layouts and the wire speak dtype *names* ("bfloat16"); only code that builds tensors
needs torch's objects. The names and sizes here are plain Python so the router, the CLI and the
scheduler import them without torch; `torch_dtype()` imports torch on first call.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# What the engine computes in and stores weights in; a KV cache it allocates uses one of these too.
SUPPORTED_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
# What a KV layout (kv_connector.KVCacheLayout, a store layout) may describe: fp8 caches included.
KV_LAYOUT_DTYPES: tuple[str, ...] = (*SUPPORTED_DTYPES, "float8_e4m3fn", "float8_e5m2")
# Bytes per element, by name (read-only: one table for the whole process).
ITEMSIZE = MappingProxyType({"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1})


def itemsize(name: str) -> int:
    """Bytes per element of dtype `name`; ValueError naming the known ones."""
    try:
        return ITEMSIZE[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {list(ITEMSIZE)}") from None


def torch_dtype(name: str) -> torch.dtype:
    """torch's dtype object for `name` (imports torch)."""
    import torch

    if name not in ITEMSIZE:
        raise ValueError(f"unknown dtype {name!r}; known: {list(ITEMSIZE)}")
    return getattr(torch, name)


__all__ = ["ITEMSIZE", "KV_LAYOUT_DTYPES", "SUPPORTED_DTYPES", "itemsize", "torch_dtype"]
