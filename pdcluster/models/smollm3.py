"""SmolLM3: the Llama decoder with NoPE layers (no rotary embedding on every `no_rope_layer_interval`-th
layer, or as `no_rope_layers` lists), driven by ModelConfig.layer_use_rope (hf_layers.py)."""

from __future__ import annotations

from pdcluster.models.decoder import DecoderForCausalLM


class SmolLM3ForCausalLM(DecoderForCausalLM):
    """`attention_bias` puts a bias on q/k/v and o_proj, as in Llama."""
