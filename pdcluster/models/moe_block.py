"""The sparse MoE block of Mixtral, Qwen2-MoE and Qwen3-MoE: router -> top-k experts (+ shared expert).

    logits  = gate(x)                                  (T, E), model dtype, replicated on every rank
    w, ids  = moe_router(logits, k, softmax, renorm)   float32 (kernels/moe_router.py)
    out     = experts(x, w, ids)                       grouped per expert (kernels/fused_moe.py)
    Qwen2-MoE: out += sigmoid(shared_expert_gate(x)) * shared_expert(x)

renormalisation: Mixtral always; Qwen-MoE when norm_topk_prob. The Qwen models round the routing
weights to the model dtype before weighting (transformers does), Mixtral weights in float32.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pdcluster.kernels.ops import Ops
from pdcluster.models.hf_config import ModelConfig
from pdcluster.models.layers.fused_moe import FusedMoE
from pdcluster.models.layers.linear import ReplicatedLinear
from pdcluster.models.layers.mlp import MLP


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, ops: Ops, tp: dict[str, Any]) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.model_type == "mixtral" or cfg.norm_topk_prob
        self.weights_in_model_dtype = cfg.model_type != "mixtral"
        self._ops = ops
        self.gate = ReplicatedLinear(cfg.hidden_size, cfg.num_experts, False, dtype)
        self.experts = FusedMoE(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, dtype, ops, **tp,
                                expert_parallel=cfg.expert_parallel)
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, dtype, ops, tp)
            self.shared_expert_gate = ReplicatedLinear(cfg.hidden_size, 1, False, dtype)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, H) -> (T, H)."""
        weights, ids = self._ops.moe_router(self.gate(x), self.top_k, "softmax", self.renormalize)
        if self.weights_in_model_dtype:
            weights = weights.to(x.dtype)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
