"""Moving (block, shard) objects between a rank's paged cache and staging slots (kernels/kv_pack.py).

A run of n staging slots for one shard is viewed as (n, *object_shape) -- block-major, so each
block's object is contiguous -- and permuted to the kernels' logical buffer order:

    slots (n, slot_nbytes) uint8 -> (n, 2, L, h, N, C)  [LBHNC]  -> permute -> (2, L, n, h, N, C)
                                    (n, 2, L, N, h, C)  [LBNHC]              (2, L, n, N, h, C)

The paged cache is (L, 2, num_blocks, N, H_local, C); a shard covers local heads [h0, h1).
Triton kernels on CUDA (through a device bounce buffer: staging lives in host memory for the
store), the torch references on CPU.
"""

from __future__ import annotations

import torch

from pdcluster.kernels.kv_pack import (
    pack_kv_blocks_torch,
    pack_kv_blocks_triton,
    unpack_kv_blocks_torch,
    unpack_kv_blocks_triton,
)

from .layout import StoreLayout


def shard_objects(slots: torch.Tensor, layout: StoreLayout, dtype: torch.dtype) -> torch.Tensor:
    """(n, slot_nbytes) uint8 slots -> (n, *object_shape) of `dtype`, sharing memory."""
    return slots.view(dtype).view(slots.shape[0], *layout.object_shape())


def logical(objects: torch.Tensor) -> torch.Tensor:
    """(n, 2, L, a, b, C) block-major objects -> the kernels' (2, L, n, a, b, C) buffer view."""
    return objects.permute(1, 2, 0, 3, 4, 5)


def _ids(block_ids: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(block_ids, dtype=torch.int64, device=device)


def pack_layer(kv_layer: torch.Tensor, layer: int, block_ids: list[int], objects: torch.Tensor,
               layout: StoreLayout, h0: int, h1: int) -> None:
    """objects[:, :, layer] <- layer `layer` of blocks block_ids, local heads [h0, h1).
    kv_layer is that layer's (2, num_blocks, N, H, C) slice of the cache."""
    cache = kv_layer.unsqueeze(0)  # (1, 2, nb, N, H, C): the kernels' one-layer cache
    dst = logical(objects[:, :, layer:layer + 1])  # (2, 1, n, ...)
    if cache.is_cuda:
        with torch.cuda.device(cache.device):  # Triton launches on the thread's current device
            tmp = torch.empty(dst.shape, dtype=cache.dtype, device=cache.device)
            pack_kv_blocks_triton(cache, _ids(block_ids, cache.device), tmp, layout.layout, h0, h1)
            dst.copy_(tmp)
    else:
        pack_kv_blocks_torch(cache, _ids(block_ids, cache.device), dst, layout.layout, h0, h1)


def pack_all(kv_cache: torch.Tensor, block_ids: list[int], objects: torch.Tensor, layout: StoreLayout,
             h0: int, h1: int) -> None:
    """Every layer at once (when the runner could not call us layer by layer)."""
    for layer in range(kv_cache.shape[0]):
        pack_layer(kv_cache[layer], layer, block_ids, objects, layout, h0, h1)


def unpack_blocks(objects: torch.Tensor, kv_cache: torch.Tensor, block_ids: list[int], layout: StoreLayout,
                  h0: int, h1: int) -> None:
    """Blocks block_ids, local heads [h0, h1) of the whole (L, 2, nb, N, H, C) cache <- objects."""
    if not block_ids:
        return
    src = logical(objects)
    if kv_cache.is_cuda:
        # The store's load thread calls this: a new thread's current CUDA device is 0, not the
        # rank's, and Triton launches on the current device (TP rank r's cache is on cuda:r).
        with torch.cuda.device(kv_cache.device):
            dev = src.to(kv_cache.device, non_blocking=False)
            unpack_kv_blocks_triton(dev, kv_cache, _ids(block_ids, kv_cache.device), layout.layout, h0, h1)
    else:
        unpack_kv_blocks_torch(src, kv_cache, _ids(block_ids, kv_cache.device), layout.layout, h0, h1)


__all__ = ["logical", "pack_all", "pack_layer", "shard_objects", "unpack_blocks"]
