"""Phi-3 / Phi-3.5 / Phi-4-mini: the Llama decoder whose checkpoint ships q/k/v and gate/up fused
(`qkv_proj`, `gate_up_proj`: split back by rows at load, DecoderForCausalLM.fused_checkpoint_rows),
with a sliding window on every layer when the config sets one (Phi-3-mini-4k), partial rotary
(Phi-4-mini) and LongRoPE (the 128k variants; hf_config._choose_longrope)."""

from __future__ import annotations

from pdcluster.models.decoder import DecoderForCausalLM


class Phi3ForCausalLM(DecoderForCausalLM):
    pass
