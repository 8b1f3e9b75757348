"""Dense causal attention of one request in float32: the reference the CPU attention paths
(cpu_attention.py's SDPA paths, the C prefill and decode kernels) are held to."""

from __future__ import annotations

import torch


def dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int, scale: float,
                 window: int | None) -> torch.Tensor:
    """q (n, Hq, D) at positions context_len.., k/v (S, Hk, D) from position 0 -> (n, Hq, D) float32.
    A window w: the query at position p sees keys p - w < key <= p."""
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    qpos = torch.arange(context_len, context_len + q.shape[0])[:, None]
    kpos = torch.arange(k.shape[0])[None, :]
    hidden = kpos > qpos
    if window is not None:
        hidden |= kpos <= qpos - window
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(hidden, float("-inf")).softmax(-1), v)
