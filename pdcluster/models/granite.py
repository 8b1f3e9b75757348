"""Granite (IBM Granite 3.x dense): the Llama decoder with four multipliers from its config,
embedding_multiplier, residual_multiplier, attention_multiplier (the softmax scale) and
logits_scaling (ModelConfig; applied in decoder.py, and by the one-call CPU decode driver, whose
pd_model.res_mult scales each block's output as the eager layer does)."""

from __future__ import annotations

from pdcluster.models.decoder import DecoderForCausalLM


class GraniteForCausalLM(DecoderForCausalLM):
    pass
