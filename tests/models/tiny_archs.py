"""Tiny random checkpoints of the architectures beyond tests/tiny_models.py (NoPE, sliding window,
MoE), saved by transformers itself, in float32.

    make_checkpoint("qwen3_moe", path, num_experts=6, num_experts_per_tok=3)  ->  path
"""

from __future__ import annotations

import os
from typing import Any

import torch
from tiny_models import TINY_COMMON, randomize_biases, write_wordlevel_tokenizer

# Each arch's defaults; tests override sizes, expert counts, top-k, windows and NoPE patterns.
ARCHS: dict[str, dict[str, Any]] = {
    "smollm3": {"no_rope_layer_interval": 2, "num_hidden_layers": 4, "pad_token_id": 0,
                "rope_parameters": {"rope_type": "default", "rope_theta": 2000000.0}},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 48},
    "qwen2_moe": {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 40},
    "qwen3_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 24, "head_dim": 32},
    "mistral": {},
    "qwen2": {},
}


def _classes(arch: str) -> tuple[type, type]:
    import transformers as tf

    tf.utils.logging.disable_progress_bar()
    return {
        "smollm3": (tf.SmolLM3Config, tf.SmolLM3ForCausalLM),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
        "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM),
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
    }[arch]


def make_checkpoint(arch: str, path: str | os.PathLike, seed: int = 0, dtype: torch.dtype = torch.float32,
                    **overrides: Any) -> str:
    config_cls, model_cls = _classes(arch)
    config = config_cls(**{**TINY_COMMON, **ARCHS[arch], **overrides})
    torch.manual_seed(seed)
    model = randomize_biases(model_cls(config), seed).eval()
    if arch in ("qwen2_moe", "qwen3_moe", "mixtral"):
        # transformers initialises the router to zeros (Qwen) or tiny values; random routers route.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                    param.normal_(0.0, 0.5)
    model.to(dtype).save_pretrained(str(path))
    write_wordlevel_tokenizer(path, model.config.vocab_size)
    return str(path)
