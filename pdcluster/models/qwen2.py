"""Qwen2: the Llama decoder with a bias on the q/k/v projections (never on o_proj)."""

from __future__ import annotations

from pdcluster.models.decoder import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    # hf_config forces ModelConfig.attention_bias on for Qwen2; the bias stops at q/k/v.
    O_PROJ_FOLLOWS_ATTENTION_BIAS = False
