"""KV cache write (`reshape_and_cache`): scatter new K and V rows into their cache slots.

Paged cache layout, per layer: k_cache / v_cache of shape (num_blocks, block_size, num_kv_heads,
head_dim). slot = block_id * block_size + offset; slot -1 means "do not write" (padding).
"""

from __future__ import annotations

import torch


def reshape_and_cache_torch(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """k, v: (T, Hk, D); slot_mapping: (T,) int64. With a float8 cache, values are divided by the
    per-tensor scale before the cast (dequantise by multiplying by the same scale)."""
    nb, bs, hk, d = k_cache.shape
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    kf, vf = k[valid], v[valid]
    if k_scale is not None:
        kf = kf.float() / k_scale
        vf = vf.float() / v_scale
    k_cache.view(nb * bs, hk, d)[slots] = kf.to(k_cache.dtype)
    v_cache.view(nb * bs, hk, d)[slots] = vf.to(v_cache.dtype)
