"""The attention block: qkv_proj -> (q/k RMSNorm per head) -> rope -> backend -> o_proj.

The backend (torch or Triton) owns the paged KV cache write and the attention itself; this layer
owns the projections and the position encoding, so both backends see identical q/k/v. A NoPE layer
(or a rotary dimension of 0) has no rotary module: no rotary op runs, so no kernel ever sees a
zero-size rotary dimension. `sliding_window` (tokens, None = full causal) goes to the backend.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pdcluster.kernels.ops import Ops
from pdcluster.models.layers.attention_backend import AttentionBackend, AttentionMetadata
from pdcluster.models.layers.linear import QKVParallelLinear, RowParallelLinear
from pdcluster.models.layers.norm import RMSNorm
from pdcluster.models.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary_emb: RotaryEmbedding | None,
        backend: AttentionBackend,
        ops: Ops,
        dtype: torch.dtype,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm_eps: float | None = None,  # a float turns on Qwen3's per-head q/k RMSNorm
        sliding_window: int | None = None,
        scale: float | None = None,  # softmax scale; None: 1/sqrt(head_dim) (Granite sets its own)
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        super().__init__()
        tp: dict[str, Any] = {"tp_rank": tp_rank, "tp_size": tp_size}
        self.qkv_proj = QKVParallelLinear(hidden_size, head_dim, num_heads, num_kv_heads, qkv_bias, dtype, **tp)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, o_bias, dtype, **tp)
        self.num_heads = self.qkv_proj.num_heads  # local to this rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.rotary_emb = rotary_emb
        self.sliding_window = sliding_window
        self.backend = backend
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps, dtype, ops)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps, dtype, ops)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """hidden: (T, H); kv_cache: (2, num_blocks, block_size, Hk, D) of this layer -> (T, H)."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        if self.q_norm is None and self.rotary_emb is not None:
            q, k, v = self._rotated(positions, qkv, num_tokens)
        else:
            q, k, v = self._normed_rotated(positions, qkv, num_tokens)
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale,
                                   sliding_window=self.sliding_window)  # (T, Hq, D)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))

    def _rotated(self, positions: torch.Tensor, qkv: torch.Tensor, num_tokens: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q and k sit side by side in the fused projection's output: rotated there, in place, as
        one (T, Hq + Hk, D) tensor (one rotary call instead of two: at batch-1 decode that halves
        the rope's share of a step), then split."""
        hq, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        qk = qkv[:, : (hq + hk) * d].view(num_tokens, hq + hk, d)
        self.rotary_emb.rotate(positions, qk)  # type: ignore[union-attr]
        q, k = qk[:, :hq], qk[:, hq:]
        if num_tokens > 1:  # the backends take contiguous q/k (a single token's view already is)
            q, k = q.contiguous(), k.contiguous()
        return q, k, qkv[:, (hq + hk) * d:].view(num_tokens, hk, d)

    def _normed_rotated(self, positions: torch.Tensor, qkv: torch.Tensor, num_tokens: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-head q/k RMSNorm (Qwen3) and/or no rotary: q and k get their own copies."""
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        if self.q_norm is not None:
            # Norm over head_dim: flatten heads into rows, (T, Hq*D) -> (T*Hq, D).
            q = self.q_norm(q.reshape(-1, self.head_dim))
            k = self.k_norm(k.reshape(-1, self.head_dim))
        # contiguous copies: the rotary op writes q and k in place.
        q = q.reshape(num_tokens, self.num_heads, self.head_dim).contiguous()  # (T, Hq, D)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim).contiguous()  # (T, Hk, D)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)  # (T, Hk, D)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k)
        return q, k, v
