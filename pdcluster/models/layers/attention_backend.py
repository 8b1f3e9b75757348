"""The attention backend interface: the seam where the Triton kernels plug into the model.

The model runner builds one AttentionMetadata per step; every attention layer passes it with its
own q/k/v and its layer's cache to `AttentionBackend.forward`.

Index math for a batch of B requests, T new tokens in all (requests ordered as in the step):

    query_start_loc = [0, q0, q0+q1, ..., T]        new tokens of request i: [qsl[i], qsl[i+1])
    seq_lens[i]     = context_lens[i] + query_len_i  tokens of request i whose KV exists after the write
    token j of request i sits at position context_lens[i] + j and attends to positions [0, that]
    block_tables[i, p // block_size] holds the block of position p
    slot_mapping[t] = block * block_size + offset    where new token t's K/V is written (-1: skip)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    num_reqs: int
    num_tokens: int
    query_start_loc: torch.Tensor  # (B + 1,) int32
    seq_lens: torch.Tensor  # (B,) int32
    context_lens: torch.Tensor  # (B,) int32
    block_tables: torch.Tensor  # (B, max_blocks_per_req) int32, padded with 0
    slot_mapping: torch.Tensor  # (T,) int64
    max_query_len: int
    max_seq_len: int
    # Host copies for backends that loop or branch in Python (no device sync needed).
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    context_lens_cpu: list[int]

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(ABC):
    """One instance per model; stateless across steps."""

    name: str = "abstract"

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # (T, Hq, D)
        k: torch.Tensor,  # (T, Hk, D)
        v: torch.Tensor,  # (T, Hk, D)
        k_cache: torch.Tensor,  # (num_blocks, block_size, Hk, D) of this layer
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Write k and v into the cache at meta.slot_mapping, then return causal attention of every
        new token over its request's whole context (cached prefix + new tokens): (T, Hq, D) in q's
        dtype, accumulated in float32. Hq must be a multiple of Hk (GQA). With `sliding_window` w,
        the token at position p sees only positions (p - w, p] (transformers' window)."""
