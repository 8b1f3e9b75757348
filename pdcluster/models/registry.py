"""Architecture name -> model class, and model path resolution.

The architectures are one `Registry` (pdcluster/registry.py) of lazy "module:Class" built-ins:
model classes are imported on first use (and `ARCHITECTURES` is built on access, PEP 562) so that
resolving a path or reading a config does not import torch.
"""

from __future__ import annotations

import os
from types import MappingProxyType
from typing import Any

from pdcluster.registry import Registry

# HF `architectures` entry -> "module:Class" implementing it (lazy: registering imports no torch).
_ARCHITECTURE_PATHS: dict[str, str] = {
    "LlamaForCausalLM": "pdcluster.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "pdcluster.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "pdcluster.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "pdcluster.models.qwen3:Qwen3ForCausalLM",
    "SmolLM3ForCausalLM": "pdcluster.models.smollm3:SmolLM3ForCausalLM",
    "MixtralForCausalLM": "pdcluster.models.moe:MixtralForCausalLM",
    "Qwen2MoeForCausalLM": "pdcluster.models.moe:Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM": "pdcluster.models.moe:Qwen3MoeForCausalLM",
    "Phi3ForCausalLM": "pdcluster.models.phi3:Phi3ForCausalLM",
    "GraniteForCausalLM": "pdcluster.models.granite:GraniteForCausalLM",
    "LlavaForConditionalGeneration": "pdcluster.models.llava:LlavaForConditionalGeneration",
}


# What each architecture needs beyond the Llama decoder (ARCHITECTURE.md "Models" has the long form).
# Every one also runs: TP (MoE experts split, or partitioned with enable_expert_parallel), an fp8
# KV cache, prefix caching, every KV connector; sliding windows free blocks only when every layer slides.
ARCHITECTURE_NOTES = MappingProxyType({
    "LlamaForCausalLM": "rope default/linear/llama3/yarn/dynamic, optional attention_bias and mlp_bias",
    "MistralForCausalLM": "sliding_window on every layer (blocks behind the window are freed)",
    "Qwen2ForCausalLM": "q/k/v bias; use_sliding_window slides layers >= max_window_layers (mixed: nothing freed)",
    "Qwen3ForCausalLM": "q/k RMSNorm per head, explicit head_dim; Qwen2's window rule",
    "SmolLM3ForCausalLM": "NoPE layers (no_rope_layers / no_rope_layer_interval); use_sliding_window slides them",
    "MixtralForCausalLM": "sparse MoE every layer (num_local_experts, top-k renormalised); sliding_window",
    "Qwen2MoeForCausalLM": "MoE + sigmoid-gated shared expert, dense layers by decoder_sparse_step/mlp_only_layers",
    "Qwen3MoeForCausalLM": "Qwen3 attention + MoE (norm_topk_prob); use_sliding_window slides every layer",
    "Phi3ForCausalLM": "qkv/gate_up fused in the checkpoint; sliding_window on every layer; partial rotary; longrope",
    "GraniteForCausalLM": "embedding, residual and attention multipliers, logits_scaling (eager decode layers)",
    "LlavaForConditionalGeneration": "CLIP tower + projector + Llama/Mistral/Qwen2 decoder; TP 1 only",
})


def _model_class(obj: object) -> type:
    if not isinstance(obj, type):
        raise ValueError("not a class")
    return obj


def _build_registry() -> Registry[type]:
    # Closed set: an architecture name comes from a checkpoint's config.json, so no dotted paths.
    registry: Registry[type] = Registry("model architecture", check=_model_class, allow_dotted=False)
    for arch, path in _ARCHITECTURE_PATHS.items():
        registry.register(arch, path)
    return registry


MODEL_ARCHITECTURES = _build_registry()


def __getattr__(name: str) -> Any:
    if name == "ARCHITECTURES":  # dict[str, type], built on access
        return {arch: MODEL_ARCHITECTURES.get(arch) for arch in MODEL_ARCHITECTURES.names()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def supported_architectures() -> list[str]:
    return MODEL_ARCHITECTURES.names()


def describe_architectures() -> list[tuple[str, str]]:
    """(architecture, what it needs) for every supported architecture, torch-free."""
    return [(arch, ARCHITECTURE_NOTES.get(arch, "")) for arch in MODEL_ARCHITECTURES.names()]


def get_model_class(arch: str) -> type:
    """The model class for an HF architecture name; ValueError listing the supported ones."""
    return MODEL_ARCHITECTURES.get(arch)


def resolve_model_path(model: str | None) -> str:
    """None -> the built-in demo model (written on first use); otherwise an existing local dir."""
    if model is None:
        from pdcluster.models.demo import ensure_demo_model  # lazy: writes files on first call

        return ensure_demo_model()
    path = os.path.expanduser(model)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {model!r} does not exist (only local HF checkpoint dirs are supported)")
    return path
