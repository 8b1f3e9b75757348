"""FP8 (e4m3) KV cache: per-layer scales, quantise on write, dequantise on read.

A float8_e4m3fn cache stores value / scale saturated to +-448 (kernels/cache_write.py; a plain
cast would turn out-of-range values into NaN) and attention reads value * scale. Scales are per
attention layer, per tensor (1,) or per KV head (Hk_local,), float32 on the cache's device:

  - from the checkpoint when it has them (vLLM / compressed-tensors spellings, per layer:
    `self_attn.k_scale` / `v_scale`, `self_attn.attn.k_scale`, `self_attn.kv_scale` for both,
    `self_attn.k_proj.output_scale` / `v_proj.output_scale`);
  - 1.0 otherwise, as vLLM does. Not calibrated from traffic on purpose: producer and consumer
    must decode the bytes a transfer or the store moves with the same scale, and a scale measured
    on each instance's own first requests would differ between them (and between restarts).

Backends find a layer's scales by its cache view (`KVScales.for_cache`): the runner's per-layer
views are fixed for its life, so no model or attention-layer signature changes.

The torch backend reads an fp8 cache through `DequantStep`: once per step it lists the blocks the
step's block tables name and remaps the tables onto a compact copy; per layer it dequantises those
blocks to float32 (`dequant_blocks`), so the float-cache attention code runs unchanged on them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

import torch

from pdcluster.models.layers.attention_backend import AttentionMetadata

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3 value
_SCALE_NAME = re.compile(
    r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:attn\.)?(?:(k_scale|v_scale|kv_scale)|(k|v)_proj\.output_scale)$")


def _per_head(scale: torch.Tensor) -> torch.Tensor | float:
    """A (Hk,) scale broadcasts over (..., Hk, D) as (Hk, 1); a per-tensor one stays a scalar tensor."""
    return scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(())


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (..., Hk, D) -> float8_e4m3fn of x / scale, clamped to +-448 (no NaN for large values)."""
    return (x.float() / _per_head(scale)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(x8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """float8 (..., Hk, D) -> x8 * scale in float32 (then `dtype`)."""
    return (x8.float() * _per_head(scale)).to(dtype)


def fake_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """dequantize(quantize(x)) in x's dtype: exactly what attention reads back from an fp8 cache."""
    return dequantize(quantize(x, scale), scale, x.dtype)


@dataclasses.dataclass
class KVScales:
    """Per-layer (k_scale, v_scale) float32 tensors, looked up by the layer's K cache view."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    source: str  # "checkpoint" or "default 1.0"
    _by_ptr: dict[int, int] = dataclasses.field(default_factory=dict)

    def bind(self, layer_kv_caches: Iterable[torch.Tensor]) -> None:
        """Remember which layer each (2, num_blocks, block_size, Hk, D) cache view belongs to."""
        self._by_ptr = {kv[0].data_ptr(): i for i, kv in enumerate(layer_kv_caches)}

    def knows(self, k_cache: torch.Tensor) -> bool:
        return k_cache.data_ptr() in self._by_ptr

    def for_cache(self, k_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        i = self._by_ptr.get(k_cache.data_ptr())
        if i is None:  # a cache the runner did not allocate (kernel tests): the default scale
            one = torch.ones(1, dtype=torch.float32, device=k_cache.device)
            return one, one
        return self.k[i], self.v[i]


def load_kv_scales(model_path: str, num_layers: int, num_kv_heads: int, device: torch.device,
                   tp_rank: int = 0, tp_size: int = 1) -> KVScales:
    """The checkpoint's KV scales (per tensor or per KV head, sliced to this TP rank), 1.0 for a
    layer without them. A per-head scale must have num_kv_heads (the model's total) entries."""
    from pdcluster.models.loader import iter_checkpoint_slices  # lazy: loader imports the model zoo

    found: dict[tuple[int, str], torch.Tensor] = {}
    for name, tensor in iter_checkpoint_slices(model_path):
        m = _SCALE_NAME.search(name)
        if m is None or int(m.group(1)) >= num_layers:
            continue
        which = m.group(2) or f"{m.group(3)}_scale"
        value = tensor[...].float().reshape(-1)  # [...]: also a 0-d (per-tensor) scale
        for kind in (("k_scale", "v_scale") if which == "kv_scale" else (which,)):
            found.setdefault((int(m.group(1)), kind), value)
    local = max(1, num_kv_heads // tp_size)
    first = tp_rank * local if num_kv_heads >= tp_size else tp_rank * num_kv_heads // tp_size

    def scale(layer: int, kind: str) -> torch.Tensor:
        s = found.get((layer, kind), torch.ones(1))
        if s.numel() not in (1, num_kv_heads):
            raise ValueError(f"layer {layer} {kind}: {s.numel()} values, expected 1 or {num_kv_heads} (per KV head)")
        if not torch.isfinite(s).all() or (s <= 0).any():
            raise ValueError(f"layer {layer} {kind} must be finite and > 0, got {s.tolist()}")
        return (s if s.numel() == 1 else s[first:first + local]).to(device).contiguous()

    ks, vs = [scale(i, "k_scale") for i in range(num_layers)], [scale(i, "v_scale") for i in range(num_layers)]
    for i in range(num_layers):  # the kernels take k and v scales of one granularity: widen a scalar
        if ks[i].numel() != vs[i].numel():
            ks[i], vs[i] = ks[i].expand(local).contiguous(), vs[i].expand(local).contiguous()
    return KVScales(ks, vs, "checkpoint" if found else "default 1.0")


def kv_scales_digest(model_path: str, num_layers: int, num_kv_heads: int) -> str:
    """A digest of every layer's k/v scales as this checkpoint resolves them (1.0 where it has none),
    each widened to all num_kv_heads, so it is the same on every TP rank and for equal values of
    either granularity. Two instances may exchange fp8 bytes only when their digests are equal: the
    same bytes decoded with another scale are other values (connectors put it in their fingerprints)."""
    import hashlib

    scales = load_kv_scales(model_path, num_layers, num_kv_heads, torch.device("cpu"))
    h = hashlib.sha256(b"pdcluster-kv-scales-v1")
    for k, v in zip(scales.k, scales.v):
        for s in (k, v):
            h.update(s.float().expand(num_kv_heads).contiguous().numpy().tobytes())
    return h.hexdigest()[:32]


def dequant_blocks(cache: torch.Tensor, blocks: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float8 cache (num_blocks, block_size, Hk, D), block ids (U,) -> (U, block_size, Hk, D) float32."""
    return dequantize(cache.index_select(0, blocks), scale)


class DequantStep:
    """Per step (keyed on the AttentionMetadata object, one per step): the blocks its tables name
    and a metadata copy whose block tables index the compact dequantised copy instead."""

    def __init__(self) -> None:
        self._meta: AttentionMetadata | None = None
        self._blocks = torch.empty(0, dtype=torch.long)
        self._remapped: AttentionMetadata | None = None

    def get(self, meta: AttentionMetadata, num_blocks: int) -> tuple[torch.Tensor, AttentionMetadata]:
        if self._meta is not meta or self._remapped is None:
            tables = meta.block_tables
            blocks = torch.unique(tables.long())  # padding entries name block 0: harmless
            lut = torch.zeros(num_blocks, dtype=tables.dtype, device=tables.device)
            lut[blocks] = torch.arange(blocks.numel(), dtype=tables.dtype, device=tables.device)
            self._meta, self._blocks = meta, blocks
            self._remapped = dataclasses.replace(meta, block_tables=lut[tables.long()])
        return self._blocks, self._remapped


__all__ = ["FP8_DTYPE", "FP8_MAX", "DequantStep", "KVScales", "dequant_blocks", "dequantize", "fake_quant",
           "load_kv_scales", "quantize"]
