"""The pre-norm decoder-only transformer shared by every supported architecture.

The architectures differ only in flags: bias on q/k/v (Qwen2), bias on o_proj (Llama with
attention_bias), RMSNorm on q and k per head (Qwen3), tied embeddings (small Qwen), and per layer
(ModelConfig.uses_rope / window / is_moe): NoPE layers (SmolLM3), sliding windows (Mistral, Qwen2),
a sparse MoE block instead of the MLP (Mixtral, Qwen-MoE); Granite's multipliers (embeddings, block
outputs, softmax scale, logits). Parameter names mirror the HF
checkpoints except for the fused projections (see `STACKED_PARAMS` and the loader's expert names).

Numerics follow transformers: residual adds in the model dtype, norm statistics in float32. The
residual stream is carried as (hidden, residual) so each norm fuses the preceding add:

    layer i:  hidden, residual = input_norm(hidden + residual)   # add of layer i-1's MLP output
              hidden           = attn(hidden)
              hidden, residual = post_attn_norm(hidden + residual)
              hidden           = mlp(hidden)
    final:    hidden, _        = norm(hidden + residual)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pdcluster.dtypes import torch_dtype
from pdcluster.kernels.ops import Ops, get_ops
from pdcluster.models.cpu_decode_step import DecodeStep
from pdcluster.models.hf_config import ModelConfig
from pdcluster.models.layers.attention import Attention
from pdcluster.models.layers.attention_backend import AttentionBackend, AttentionMetadata
from pdcluster.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pdcluster.models.layers.mlp import MLP
from pdcluster.models.layers.norm import RMSNorm
from pdcluster.models.layers.rotary import RotaryEmbedding
from pdcluster.models.moe_block import SparseMoeBlock

# (fused parameter name part, checkpoint name part, shard id): q/k/v and gate/up are fused at load.
STACKED_PARAMS: tuple[tuple[str, str, str | int], ...] = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, rotary: RotaryEmbedding | None, backend: AttentionBackend,
                 ops: Ops, dtype: torch.dtype, o_bias: bool, tp: dict[str, Any]) -> None:
        super().__init__()
        self.self_attn = Attention(
            cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            rotary if cfg.uses_rope(index) else None, backend, ops, dtype, qkv_bias=cfg.attention_bias,
            o_bias=o_bias, qk_norm_eps=cfg.rms_norm_eps if cfg.qk_norm else None, sliding_window=cfg.window(index),
            scale=cfg.attention_multiplier, **tp)
        self.residual_multiplier = cfg.residual_multiplier  # Granite: a block's output, scaled
        self.mlp: nn.Module = (SparseMoeBlock(cfg, dtype, ops, tp) if cfg.is_moe(index)
                               else MLP(cfg.hidden_size, cfg.intermediate_size, dtype, ops, tp, cfg.mlp_bias))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:  # first layer: the embedding output is the residual stream
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        if self.residual_multiplier != 1.0:
            hidden = hidden * self.residual_multiplier
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        hidden = self.mlp(hidden)
        if self.residual_multiplier != 1.0:
            hidden = hidden * self.residual_multiplier
        return hidden, residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, ops: Ops, dtype: torch.dtype,
                 o_bias: bool, tp: dict[str, Any]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, **tp)
        # One rope table shared by every layer (it is position-only); none at all for a rotary dim of 0.
        rotary = RotaryEmbedding(cfg.rotary_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                 cfg.rope_scaling_dict, ops.rotary_embedding, cfg.rope_is_neox_style
                                 ) if cfg.rotary_dim > 0 else None
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, rotary, backend, ops, dtype, o_bias, tp) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.embedding_multiplier = cfg.embedding_multiplier  # Granite
        # Decode steps as one C call where the layers allow it (cpu_decode_step.py); not a module.
        self.decode_step = DecodeStep()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Any,
                meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.embedding_multiplier != 1.0:
            hidden = hidden * self.embedding_multiplier
        fast = self.decode_step.run(self, hidden, positions, kv_caches, meta)
        if fast is not None:
            return fast
        residual = None
        for i, layer in enumerate(self.layers):
            # kv_caches[i]: (2, num_blocks, block_size, Hk, D), from the runner's one 6-D tensor.
            hidden, residual = layer(positions, hidden, residual, kv_caches[i], meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DecoderForCausalLM(nn.Module):
    """Base of every supported architecture; subclasses only set the class flags."""

    # Llama and Qwen3 put `attention_bias` on o_proj too; Qwen2 has q/k/v bias only.
    O_PROJ_FOLLOWS_ATTENTION_BIAS = True
    # (checkpoint name part, ours): module names that differ from ours (Mixtral's block_sparse_moe).
    CHECKPOINT_RENAMES: tuple[tuple[str, str], ...] = ()

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend, ops_backend: str = "torch",
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.config = config
        ops = get_ops(ops_backend)
        dtype = torch_dtype(config.dtype)
        tp = {"tp_rank": tp_rank, "tp_size": tp_size}
        o_bias = config.attention_bias and self.O_PROJ_FOLLOWS_ATTENTION_BIAS
        self.model = DecoderModel(config, attn_backend, ops, dtype, o_bias, tp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, dtype, **tp)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Any,
                attn_meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: (T,) -> hidden states (T, H) in the model dtype."""
        return self.model(input_ids, positions, kv_caches, attn_meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (N, H) -> logits (N, V) float32."""
        logits = self.lm_head(hidden)
        scaling = self.config.logits_scaling
        return logits if scaling == 1.0 else logits / scaling  # Granite

    def stacked_params(self) -> tuple[tuple[str, str, str | int], ...]:
        return STACKED_PARAMS

    def fused_checkpoint_rows(self, name: str) -> list[tuple[str | int, int, int]] | None:
        """(shard id, first row, rows) of each projection inside a checkpoint tensor that is already
        fused (Phi-3 ships `qkv_proj` and `mlp.gate_up_proj`); None for any other tensor."""
        c = self.config
        if ".self_attn.qkv_proj." in name:
            q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
            return [("q", 0, q), ("k", q, kv), ("v", q + kv, kv)]
        if ".mlp.gate_up_proj." in name and not c.num_experts:
            return [(0, 0, c.intermediate_size), (1, c.intermediate_size, c.intermediate_size)]
        return None
