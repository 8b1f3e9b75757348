"""Granite (IBM Granite 3.x dense): the Llama decoder with four multipliers from its config,
embedding_multiplier, residual_multiplier, attention_multiplier (the softmax scale) and
logits_scaling (ModelConfig; applied in decoder.py). The one-call CPU decode driver does not
scale block outputs, so Granite's decode steps run the eager layers (cpu_decode_step.why_not)."""

from __future__ import annotations

from pdcluster.models.decoder import DecoderForCausalLM


class GraniteForCausalLM(DecoderForCausalLM):
    pass
