"""Rotary position embedding: builds the float32 cos/sin table once and applies it per step.

    cos_sin_cache[p] = [cos(p * inv_freq) | sin(p * inv_freq)]     shape (max_position, rotary_dim)

inv_freq follows transformers' rope init functions exactly (same float32 ops in the same order),
so the table matches the one transformers computes on the fly.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def default_inv_freq(base: float, rotary_dim: int) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    return 1.0 / (base ** exponents)  # (rotary_dim / 2,)


def llama3_inv_freq(base: float, rotary_dim: int, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths are divided by `factor`, short ones kept, the band in
    between interpolated smoothly."""
    inv_freq = default_inv_freq(base, rotary_dim)
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def compute_inv_freq(base: float, rotary_dim: int, scaling: dict[str, Any] | None) -> torch.Tensor:
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return default_inv_freq(base, rotary_dim)
    if rope_type == "linear":
        # transformers scales the positions by 1/factor; scaling inv_freq is the same product.
        return default_inv_freq(base, rotary_dim) / scaling["factor"]
    if rope_type == "llama3":
        return llama3_inv_freq(base, rotary_dim, scaling)
    raise ValueError(f"unsupported rope type {rope_type!r}; supported: ['default', 'linear', 'llama3']")


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, max_position: int, base: float, scaling: dict[str, Any] | None,
                 rotary_op: Callable, is_neox_style: bool = True) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        self.is_neox_style = is_neox_style
        self._rotary_op = rotary_op
        inv_freq = compute_inv_freq(base, rotary_dim, scaling)
        positions = torch.arange(max_position, dtype=torch.int64).to(torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # (max_position, rotary_dim / 2)
        # Not persistent: derived from the config, never read from a checkpoint.
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: (T, Hq, D), k: (T, Hk, D); rotates the first rotary_dim channels of each head."""
        return self._rotary_op(positions, q, k, self.cos_sin_cache, self.is_neox_style)

    def rotate(self, positions: torch.Tensor, qk: torch.Tensor) -> None:
        """Rotate, in place, every head of qk (T, H, D): q and k side by side, one op call."""
        self._rotary_op(positions, qk, qk[:, :0], self.cos_sin_cache, self.is_neox_style)
