"""Read a rank's shard of a checkpoint tensor without reading the whole tensor.

The loader hands each `weight_loader` either a torch.Tensor (tests, tools) or a lazy safetensors
slice (`safe_open(...).get_slice(name)`). Indexing the lazy slice reads only the requested bytes
from the file, so a rank of a TP-t instance reads ~1/t of every sharded tensor.
"""

from __future__ import annotations

from typing import Any

import torch

# A torch.Tensor or a safetensors PySafeSlice (typed Any: the slice class is not importable).
Loaded = Any


def shape_of(loaded: Loaded) -> tuple[int, ...]:
    if isinstance(loaded, torch.Tensor):
        return tuple(loaded.shape)
    return tuple(loaded.get_shape())


def narrow(loaded: Loaded, dim: int, start: int, length: int) -> torch.Tensor:
    """loaded[..., start:start+length, ...] along `dim`, materialised (only that part is read)."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, length)
    shape = shape_of(loaded)
    if not 0 <= start and start + length <= shape[dim]:
        raise ValueError(f"shard [{start}, {start + length}) outside dim {dim} of size {shape[dim]}")
    index = [slice(None)] * len(shape)
    index[dim] = slice(start, start + length)
    return loaded[tuple(index)]


def whole(loaded: Loaded) -> torch.Tensor:
    """The whole tensor (replicated parameters: norms, biases after a reduce)."""
    if isinstance(loaded, torch.Tensor):
        return loaded
    return loaded[:]
