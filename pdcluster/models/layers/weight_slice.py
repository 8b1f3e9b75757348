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


class Rows:
    """Rows [start, start + length) of a lazy slice, itself a lazy slice: a checkpoint that stores
    q/k/v (or gate/up) as one tensor (Phi-3's qkv_proj) is handed to the fused parameter's loader
    one projection at a time, and a TP rank still reads only its own rows."""

    def __init__(self, loaded: Loaded, start: int, length: int) -> None:
        shape = shape_of(loaded)
        if not (0 <= start and start + length <= shape[0]):
            raise ValueError(f"rows [{start}, {start + length}) outside a tensor of {shape[0]} rows")
        self._loaded, self._start, self._length, self._shape = loaded, start, length, shape

    def get_shape(self) -> list[int]:
        return [self._length, *self._shape[1:]]

    def __getitem__(self, index: Any) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        first = index[0] if index else slice(None)
        if not isinstance(first, slice) or first.step not in (None, 1):
            raise ValueError("Rows supports plain slices only")
        lo, hi, _ = first.indices(self._length)
        return self._loaded[(slice(self._start + lo, self._start + hi), *index[1:])]


def rows(loaded: Loaded, start: int, length: int) -> Loaded:
    """loaded's rows [start, start + length), lazy when loaded is."""
    return loaded.narrow(0, start, length) if isinstance(loaded, torch.Tensor) else Rows(loaded, start, length)
