"""Rotary position embedding: builds the float32 cos/sin table once and applies it per step.

    cos_sin_cache[p] = [cos(p * inv_freq) | sin(p * inv_freq)]     shape (max_position, rotary_dim)

inv_freq follows transformers' rope init functions exactly (same float32 ops in the same order),
so the table matches the one transformers computes on the fly. YaRN also scales cos and sin by its
attention factor, in the table, as transformers scales them after computing them.
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


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature (paper eq. 21): 0.1 * mscale * ln(factor) + 1, 1 when not scaled."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(base: float, rotary_dim: int, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN ("NTK-by-parts"): dimensions that turn fewer than beta_slow times over the original
    context are interpolated (inv_freq / factor), those that turn more than beta_fast times are kept,
    a linear ramp between; cos/sin are scaled by the attention factor. -> (inv_freq, factor)."""
    factor = float(scaling["factor"])
    old_len = scaling["original_max_position_embeddings"]
    fast, slow = float(scaling.get("beta_fast", 32.0)), float(scaling.get("beta_slow", 1.0))

    def dim_of(rotations: float) -> float:  # the dimension whose wavelength fits `rotations` times in old_len
        return rotary_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (the original frequency), 0: interpolate
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2).to(dtype=torch.float32) / rotary_dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) if mscale and mscale_all
                     else yarn_mscale(factor))
    return inv_freq, float(attention)


def longrope_inv_freq(base: float, rotary_dim: int, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): per-dimension factors divide the frequencies, the short or the long set
    (hf_config._choose_longrope fixed which: `use_long`); cos and sin are scaled by the attention
    factor, sqrt(1 + ln(factor) / ln(original length)) unless given, as transformers computes it."""
    factor, old = scaling["factor"], scaling["original_max_position_embeddings"]
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old))
    ext = torch.tensor(scaling["long_factor" if scaling.get("use_long") else "short_factor"], dtype=torch.float32)
    shape = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (ext * base ** shape), float(attention)


def compute_rope(base: float, rotary_dim: int, scaling: dict[str, Any] | None) -> tuple[torch.Tensor, float]:
    """-> (inv_freq, the factor cos and sin are scaled by)."""
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return default_inv_freq(base, rotary_dim), 1.0
    if rope_type == "linear":
        # transformers scales the positions by 1/factor; scaling inv_freq is the same product.
        return default_inv_freq(base, rotary_dim) / scaling["factor"], 1.0
    if rope_type == "llama3":
        return llama3_inv_freq(base, rotary_dim, scaling), 1.0
    if rope_type == "yarn":
        return yarn_inv_freq(base, rotary_dim, scaling)
    if rope_type == "longrope":
        return longrope_inv_freq(base, rotary_dim, scaling)
    raise ValueError(f"unsupported rope type {rope_type!r}; supported: ['default', 'linear', 'llama3', 'yarn', "
                     "'longrope']")


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, max_position: int, base: float, scaling: dict[str, Any] | None,
                 rotary_op: Callable, is_neox_style: bool = True) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        self.is_neox_style = is_neox_style
        self._rotary_op = rotary_op
        inv_freq, scale = compute_rope(base, rotary_dim, scaling)
        positions = torch.arange(max_position, dtype=torch.int64).to(torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # (max_position, rotary_dim / 2)
        cos, sin = freqs.cos(), freqs.sin()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        # Not persistent: derived from the config, never read from a checkpoint.
        self.register_buffer("cos_sin_cache", torch.cat((cos, sin), dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: (T, Hq, D), k: (T, Hk, D); rotates the first rotary_dim channels of each head."""
        return self._rotary_op(positions, q, k, self.cos_sin_cache, self.is_neox_style)

    def rotate(self, positions: torch.Tensor, qk: torch.Tensor) -> None:
        """Rotate, in place, every head of qk (T, H, D): q and k side by side, one op call."""
        self._rotary_op(positions, qk, qk[:, :0], self.cos_sin_cache, self.is_neox_style)
