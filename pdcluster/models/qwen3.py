"""Qwen3: the Llama decoder plus RMSNorm over head_dim on q and k before rope
(ModelConfig.qk_norm), and an explicit head_dim that need not be hidden_size / num_heads."""

from __future__ import annotations

from pdcluster.models.decoder import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    """Everything Qwen3-specific is driven by ModelConfig (qk_norm, head_dim)."""
