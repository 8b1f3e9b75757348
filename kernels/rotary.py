"""Rotary position embedding applied to Q and K.

cos_sin_cache: (max_position, rotary_dim) float32, cos in the first rotary_dim/2 columns and sin in
the last (built by pdcluster/models/layers/rotary.py, which also applies rope scaling such as llama3).
Only the first rotary_dim channels of each head rotate (partial rotary); the rest pass through.
NeoX style rotates pairs (i, i + rotary_dim/2); GPT-J style rotates interleaved pairs (2i, 2i+1).
"""

from __future__ import annotations

import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    # x: (T, H, rot) float32; cos/sin: (T, 1, rot/2)
    if is_neox:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def rotary_embedding_torch(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: (T,) int; q: (T, Hq, D); k: (T, Hk, D). Rotates in place and returns (q, k)."""
    rot = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions.long()].unsqueeze(1).chunk(2, dim=-1)  # (T, 1, rot/2)
    for t in (q, k):
        t[..., :rot] = _rotate(t[..., :rot].float(), cos, sin, is_neox).to(t.dtype)
    return q, k
