"""Llama 2/3 (and Mistral, which is Llama with a sliding window on every layer: ModelConfig.layer_windows)."""

from __future__ import annotations

from pdcluster.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """Plain pre-norm decoder; `attention_bias` (rare) puts a bias on q/k/v and o_proj."""
