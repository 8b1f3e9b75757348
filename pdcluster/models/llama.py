"""Llama 2/3 (and Mistral, which is Llama with a sliding window we bound max_model_len by)."""

from __future__ import annotations

from pdcluster.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """Plain pre-norm decoder; `attention_bias` (rare) puts a bias on q/k/v and o_proj."""
