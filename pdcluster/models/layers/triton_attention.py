"""Attention backend on the Triton kernels of pdcluster.kernels.

Per step: write the new K/V into the paged cache (reshape_and_cache_triton), then
- decode-only batches (every request brings one token): paged decode attention, split-KV;
- anything else (prefill, chunked prefill, prefix-cache hits, mixed prefill + decode): extend
  attention, which reads the cached prefix through the block table and the new tokens directly.

A layer's sliding window goes to both kernels (they skip key tiles before it and mask the rest).

Imported lazily by the model runner for attention_backend="triton"; importing this module does not
import triton (the kernels compile on first use).
"""

from __future__ import annotations

from typing import Any

import torch

from pdcluster.kernels.cache_write import reshape_and_cache_triton
from pdcluster.kernels.extend_attention import extend_attention_triton
from pdcluster.kernels.paged_attention import paged_decode_attention_triton
from pdcluster.models.layers.attention_backend import AttentionBackend, AttentionMetadata


class TritonAttentionBackend(AttentionBackend):
    """k_scale / v_scale dequantise a float8_e4m3fn KV cache (per tensor: float or 1-element tensor;
    per KV head: (Hk,) tensor) and are ignored for float caches."""

    name = "triton"

    def __init__(self, k_scale: torch.Tensor | float = 1.0, v_scale: torch.Tensor | float = 1.0) -> None:
        self._scales = (k_scale, v_scale)
        self._device_scales: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        # Per-layer scales (kv_quant.KVScales, on the cache's device), set by the runner for an fp8
        # cache; a cache it does not know (kernel tests) uses the constructor's scales.
        self.kv_scales: Any = None

    def _scales_for(self, cache: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if cache.dtype != torch.float8_e4m3fn:
            return None, None
        if self.kv_scales is not None and self.kv_scales.knows(cache):
            return self.kv_scales.for_cache(cache)
        # One host->device copy per device, not per layer and step.
        if cache.device not in self._device_scales:
            self._device_scales[cache.device] = tuple(  # type: ignore[assignment]
                torch.as_tensor(s, dtype=torch.float32).reshape(-1).to(cache.device) for s in self._scales)
        return self._device_scales[cache.device]

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        k_scale, v_scale = self._scales_for(k_cache)
        reshape_and_cache_triton(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        num_reqs = meta.num_reqs
        block_tables = meta.block_tables[:num_reqs]
        if meta.is_decode_only and q.shape[0] >= num_reqs:
            # Token i is request i's only new token; rows past num_reqs are padding.
            out = torch.zeros_like(q) if q.shape[0] > num_reqs else torch.empty_like(q)
            paged_decode_attention_triton(
                q[:num_reqs], k_cache, v_cache, block_tables, meta.seq_lens[:num_reqs], scale,
                k_scale, v_scale, max_seq_len=meta.max_seq_len, out=out[:num_reqs], sliding_window=sliding_window)
            return out
        # The kernel leaves rows past the last request's tokens alone; zero them if there are any.
        out = torch.zeros_like(q) if q.shape[0] > sum(meta.query_lens_cpu) else torch.empty_like(q)
        return extend_attention_triton(
            q, k, v, k_cache, v_cache, meta.query_start_loc[: num_reqs + 1], meta.context_lens[:num_reqs],
            block_tables, scale, k_scale, v_scale, out=out, sliding_window=sliding_window)
