"""Paged attention in plain torch: the CPU backend and the reference the Triton backend is tested
against.

Per step: write the new K/V into the paged cache, then
  - requests with several new tokens (prefill chunks) run one SDPA each: straight on the new
    k/v with a causal mask when nothing is cached before them, otherwise over the context gathered
    from the cache through the block table with a bottom-right-aligned causal mask;
  - requests with one new token (decode) run as ONE batched SDPA over their gathered contexts,
    with a padding mask, so a decode step costs one call per layer whatever the batch size.
Softmax runs in float32 inside SDPA for every input dtype (as in transformers' sdpa path).
A sliding window w adds "key position > query position - w" to each mask (the fresh-prefill case
then builds its mask instead of using is_causal); decode then gathers only the last w positions.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from pdcluster.kernels.cache_write import reshape_and_cache_torch
from pdcluster.models.layers import cpu_attention, kv_quant
from pdcluster.models.layers.attention_backend import AttentionBackend, AttentionMetadata


def gather_context(cache: torch.Tensor, block_tables: torch.Tensor, seq_len: int) -> torch.Tensor:
    """cache: (num_blocks, block_size, Hk, D); block_tables: (B, max_blocks) ->
    (B, seq_len, Hk, D): the first seq_len cached tokens of each request (padding where shorter)."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = cache[block_tables[:, :num_blocks]]  # (B, num_blocks, block_size, Hk, D)
    return blocks.flatten(1, 2)[:, :seq_len]  # (B, num_blocks * block_size, Hk, D) -> (B, S, Hk, D)


def _gather_windows(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode with a sliding window reads only the last `window` positions of each request:
    -> k, v (B, window, Hk, D) and valid (B, window) (False past a request shorter than the window)."""
    block_size = k_cache.shape[1]
    start = (seq_lens.long() - window).clamp(min=0)  # the new token at seq_len - 1 sees [start, seq_len)
    pos = start[:, None] + torch.arange(window, device=k_cache.device)[None, :]  # (B, window)
    valid = pos < seq_lens[:, None]
    pos = torch.minimum(pos, (seq_lens.long() - 1).clamp(min=0)[:, None])  # inside each request's blocks
    blocks = block_tables.long().gather(1, pos // block_size)
    return k_cache[blocks, pos % block_size], v_cache[blocks, pos % block_size], valid


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self) -> None:
        self._plans = cpu_attention.PlanCache()  # per-step gather index and masks
        self.kv_scales = kv_quant.KVScales([], [], "default 1.0")  # set by the runner for an fp8 cache
        self._dequant = kv_quant.DequantStep()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None) -> torch.Tensor:
        if k_cache.dtype == kv_quant.FP8_DTYPE:
            return self._forward_fp8(q, k, v, k_cache, v_cache, meta, scale, sliding_window)
        reshape_and_cache_torch(k, v, k_cache, v_cache, meta.slot_mapping)
        return self._attend(q, k, v, k_cache, v_cache, meta, scale, sliding_window)

    def _forward_fp8(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                     sliding_window: int | None) -> torch.Tensor:
        """Quantise on write (clamped to +-448); attention then runs on a float32 copy of the blocks
        this step reads, and on the new tokens as read back from the cache, so every path (fresh
        prefill, chunk over a prefix, decode) sees exactly dequantize(quantize(kv))."""
        ks, vs = self.kv_scales.for_cache(k_cache)
        reshape_and_cache_torch(k, v, k_cache, v_cache, meta.slot_mapping, ks, vs)
        blocks, meta = self._dequant.get(meta, k_cache.shape[0])
        kc, vc = kv_quant.dequant_blocks(k_cache, blocks, ks), kv_quant.dequant_blocks(v_cache, blocks, vs)
        return self._attend(q, kv_quant.fake_quant(k, ks), kv_quant.fake_quant(v, vs), kc, vc, meta, scale,
                            sliding_window)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None) -> torch.Tensor:
        """Attention of the new tokens once their K/V are in the cache."""
        if sliding_window is None:  # full attention: the CPU-shaped path (4-D SDPA, batched decode)
            plan = self._plans.get(meta, k_cache.shape[1])
            return cpu_attention.attention(q, k, v, k_cache, v_cache, meta, plan, scale, None)
        window = sliding_window
        if meta.is_decode_only:
            return self._decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.max_seq_len, scale,
                                window)
        out = torch.empty_like(q)
        starts = list(itertools.accumulate(meta.query_lens_cpu, initial=0))
        decode_idx = [i for i, n in enumerate(meta.query_lens_cpu) if n == 1]
        for i, query_len in enumerate(meta.query_lens_cpu):
            if query_len > 1:
                s, e = starts[i], starts[i + 1]
                out[s:e] = self._prefill(q[s:e], k[s:e], v[s:e], k_cache, v_cache, meta.block_tables[i],
                                         meta.context_lens_cpu[i], scale, window)
        if decode_idx:
            rows = torch.tensor(decode_idx, device=q.device)
            tokens = torch.tensor([starts[i] for i in decode_idx], device=q.device)
            max_seq_len = max(meta.seq_lens_cpu[i] for i in decode_idx)
            out[tokens] = self._decode(q[tokens], k_cache, v_cache, meta.block_tables[rows], meta.seq_lens[rows],
                                       max_seq_len, scale, window)
        return out

    @staticmethod
    def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, block_table: torch.Tensor, context_len: int, scale: float,
                 window: int | None = None) -> torch.Tensor:
        """One request's chunk: q (n, Hq, D), k/v (n, Hk, D) -> (n, Hq, D)."""
        query_len = q.shape[0]
        qh = q.transpose(0, 1)  # (Hq, n, D)
        if context_len == 0 and (window is None or window >= query_len):
            # Nothing cached before the chunk (and no window shorter than it): top-left causal.
            out = F.scaled_dot_product_attention(qh, k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
                                                 scale=scale, enable_gqa=True)
            return out.transpose(0, 1)
        seq_len = context_len + query_len
        kc = gather_context(k_cache, block_table[None], seq_len)[0].to(q.dtype)  # (S, Hk, D)
        vc = gather_context(v_cache, block_table[None], seq_len)[0].to(q.dtype)
        # Query j sits at position context_len + j and sees positions [0, context_len + j]
        # (only the last `window` of them with a sliding window).
        key_pos = torch.arange(seq_len, device=q.device)
        query_pos = torch.arange(context_len, seq_len, device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None]  # (n, S)
        if window is not None:
            mask &= key_pos[None, :] > query_pos[:, None] - window
        out = F.scaled_dot_product_attention(qh, kc.transpose(0, 1), vc.transpose(0, 1), attn_mask=mask,
                                             scale=scale, enable_gqa=True)
        return out.transpose(0, 1)

    @staticmethod
    def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                seq_lens: torch.Tensor, max_seq_len: int, scale: float, window: int | None = None) -> torch.Tensor:
        """One new token per request: q (B, Hq, D) -> (B, Hq, D), all requests in one SDPA call."""
        if window is not None and max_seq_len > window:
            kc, vc, valid = _gather_windows(k_cache, v_cache, block_tables, seq_lens, window)
            kc, vc = kc.to(q.dtype), vc.to(q.dtype)
        else:
            kc = gather_context(k_cache, block_tables, max_seq_len).to(q.dtype)  # (B, S, Hk, D)
            vc = gather_context(v_cache, block_tables, max_seq_len).to(q.dtype)
            valid = torch.arange(max_seq_len, device=q.device)[None, :] < seq_lens[:, None]  # (B, S)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # (B, Hq, 1, D)
            kc.transpose(1, 2),  # (B, Hk, S, D)
            vc.transpose(1, 2),
            attn_mask=valid[:, None, None, :],  # (B, 1, 1, S)
            scale=scale,
            enable_gqa=True,
        )
        return out.squeeze(2)  # (B, Hq, D)
