"""Paged attention in plain torch: the CPU backend and the reference the Triton backend is tested
against.

Per step: write the new K/V into the paged cache (quantised for an fp8 cache), then attend through
cpu_attention.py for every layer, full or sliding-window: runs of equal-length fresh prefills as one
4-D causal SDPA, chunks over a cached prefix through one gather, decodes as one head-major batched
product. A sliding window w adds "key position > query position - w" to each mask and narrows
every cache read to the keys the window can see.
"""

from __future__ import annotations

import torch

from pdcluster.kernels.cache_write import reshape_and_cache_torch, write_index
from pdcluster.models.layers import cpu_attention, kv_quant
from pdcluster.models.layers.attention_backend import AttentionBackend, AttentionMetadata


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self) -> None:
        self._plans = cpu_attention.PlanCache()  # per-step gather index and masks
        self.kv_scales = kv_quant.KVScales([], [], "default 1.0")  # set by the runner for an fp8 cache
        self._dequant = kv_quant.DequantStep()
        self._write_meta: AttentionMetadata | None = None
        self._write: tuple[torch.Tensor, torch.Tensor | None] = (torch.empty(0, dtype=torch.int64), None)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None) -> torch.Tensor:
        if k_cache.dtype == kv_quant.FP8_DTYPE:
            return self._forward_fp8(q, k, v, k_cache, v_cache, meta, scale, sliding_window)
        reshape_and_cache_torch(k, v, k_cache, v_cache, meta.slot_mapping, index=self._write_index(meta))
        return self._attend(q, k, v, k_cache, v_cache, meta, scale, sliding_window)

    def _write_index(self, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's cache-write slots, computed by the first layer and reused by the others
        (keyed like the plans: one AttentionMetadata per step)."""
        if self._write_meta is not meta:
            self._write_meta, self._write = meta, write_index(meta.slot_mapping)
        return self._write

    def _forward_fp8(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                     sliding_window: int | None) -> torch.Tensor:
        """Quantise on write (clamped to +-448); attention then runs on a float32 copy of the blocks
        this step reads, and on the new tokens as read back from the cache, so every path (fresh
        prefill, chunk over a prefix, decode) sees exactly dequantize(quantize(kv))."""
        ks, vs = self.kv_scales.for_cache(k_cache)
        reshape_and_cache_torch(k, v, k_cache, v_cache, meta.slot_mapping, ks, vs, index=self._write_index(meta))
        blocks, meta = self._dequant.get(meta, k_cache.shape[0])
        kc, vc = kv_quant.dequant_blocks(k_cache, blocks, ks), kv_quant.dequant_blocks(v_cache, blocks, vs)
        return self._attend(q, kv_quant.fake_quant(k, ks), kv_quant.fake_quant(v, vs), kc, vc, meta, scale,
                            sliding_window)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None) -> torch.Tensor:
        """Attention of the new tokens once their K/V are in the cache (cpu_attention.py: 4-D SDPA,
        batched fresh prefills, head-major decode; a window reads only the keys it can see)."""
        plan = self._plans.get(meta, k_cache.shape[1])
        return cpu_attention.attention(q, k, v, k_cache, v_cache, meta, plan, scale, sliding_window)
