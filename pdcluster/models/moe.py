"""The MoE architectures: the shared decoder with a SparseMoeBlock (moe_block.py) on the layers
ModelConfig.layer_moe marks. Everything else is the dense model each one extends."""

from __future__ import annotations

from pdcluster.models.decoder import DecoderForCausalLM


class MixtralForCausalLM(DecoderForCausalLM):
    """Mistral + 8-ish experts per layer, top-2, always renormalised; no shared expert."""

    CHECKPOINT_RENAMES = ((".block_sparse_moe.", ".mlp."),)


class Qwen2MoeForCausalLM(DecoderForCausalLM):
    """Qwen2 (q/k/v bias from `qkv_bias`, none on o_proj) + experts + a sigmoid-gated shared expert."""

    O_PROJ_FOLLOWS_ATTENTION_BIAS = False


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    """Qwen3 (q/k RMSNorm per head) + experts."""
