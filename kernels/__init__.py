"""pdcluster.kernels: one file per op family, each a Triton kernel + launcher + torch reference.

    norm.py              rms_norm_*, fused_add_rms_norm_*
    rotary.py            rotary_embedding_*            (NeoX / GPT-J, partial rotary)
    activation.py        silu_and_mul_*
    cache_write.py       reshape_and_cache_*           (float8 e4m3 quantisation)
    paged_attention.py   paged_decode_attention_*      (GQA, split-KV, float8 KV)
    paged_decode_cpu.py  paged_decode_attention_cpu    (C kernel, csrc/; built by native.py)
    gemv_bf16_cpu.py     gemv_bf16, gemv_bf16_torch    (C kernels: small-M products over bf16 weights,
                                                       float32 tiles or AVX512-BF16 pairs)
    decode_step_cpu.py   run, ModelDesc, LayerDesc     (C: every layer of a decode step in one call)
    elementwise_cpu.py   rms_norm_cpu, fused_add_rms_norm_cpu, rotary_embedding_cpu, silu_and_mul_cpu
                                                       (C kernels, float32; fall back to the refs)
    argmax_cpu.py        argmax_rows                   (C: greedy sampling's argmax over logits)
    extend_attention.py  extend_attention_*            (varlen causal over a cached prefix)
    kv_pack.py           pack_kv_blocks_*, unpack_kv_blocks_*, pack_shape (LBHNC / LBNHC buffers)
    moe_router.py        moe_router_*
    fused_moe.py         fused_moe_*                   (MoE experts, grouped per expert)
    ops.py               get_ops(backend): the element-wise ops the model layers call

Every name is importable from this package, resolved on first access: importing the package
imports neither torch nor triton, and no kernel module imports triton before its first launch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "norm": ("rms_norm_torch", "rms_norm_triton", "fused_add_rms_norm_torch", "fused_add_rms_norm_triton"),
    "rotary": ("rotary_embedding_torch", "rotary_embedding_triton"),
    "activation": ("silu_and_mul_torch", "silu_and_mul_triton"),
    "cache_write": ("reshape_and_cache_torch", "reshape_and_cache_triton"),
    "paged_attention": ("paged_decode_attention_torch", "paged_decode_attention_triton"),
    "paged_decode_cpu": ("paged_decode_attention_cpu",),
    "gemv_bf16_cpu": ("gemv_bf16", "gemv_bf16_torch"),
    "elementwise_cpu": ("rms_norm_cpu", "fused_add_rms_norm_cpu", "rotary_embedding_cpu", "silu_and_mul_cpu"),
    "argmax_cpu": ("argmax_rows",),
    "extend_attention": ("extend_attention_torch", "extend_attention_triton"),
    "kv_pack": ("LAYOUTS", "pack_shape", "pack_kv_blocks_torch", "pack_kv_blocks_triton",
                "unpack_kv_blocks_torch", "unpack_kv_blocks_triton"),
    "moe_router": ("moe_router_torch", "moe_router_triton"),
    "fused_moe": ("fused_moe_torch", "fused_moe_triton"),
    "ops": ("Ops", "get_ops"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
