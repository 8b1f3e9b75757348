"""LLaVA: CLIP vision tower + two-layer projector + a Llama / Mistral / Qwen2 decoder.

    image pixels -> vision_tower (selected hidden states) -> multi_modal_projector
        -> one embedding per placeholder token (image_token_index), scattered by the model runner
           into the decoder's input embeddings at the image's placeholder positions

The decoder is the shared DecoderModel (decoder.py) under the same parameter names as the text
models, so the KV cache, attention backends and loader work unchanged. Checkpoint names of both
transformers layouts are mapped onto ours (CHECKPOINT_RENAMES): the saved one
(`language_model.model.*`, `vision_tower[.vision_model].*`, `multi_modal_projector.*`) and the
in-memory one of transformers >= 4.52 (`model.language_model.*`, `model.vision_tower.*`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pdcluster.dtypes import torch_dtype
from pdcluster.models.clip_vision import CLIPVisionTower, activation
from pdcluster.models.decoder import DecoderForCausalLM
from pdcluster.models.hf_config import ModelConfig
from pdcluster.models.layers.attention_backend import AttentionBackend, AttentionMetadata
from pdcluster.models.layers.linear import ReplicatedLinear
from pdcluster.models.llava_config import LlavaVisionConfig, load_llava_vision_config


class LlavaProjector(nn.Module):
    def __init__(self, cfg: LlavaVisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.act = cfg.projector_hidden_act
        in_features = cfg.hidden_size * len(cfg.feature_layers)
        self.linear_1 = ReplicatedLinear(in_features, cfg.text_hidden_size, cfg.projector_bias, dtype)
        self.linear_2 = ReplicatedLinear(cfg.text_hidden_size, cfg.text_hidden_size, cfg.projector_bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(activation(self.act, self.linear_1(x)))


_CHECKPOINT_RENAMES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("vision_tower.vision_model.", "vision_tower."),
)


class LlavaEncoder(nn.Module):
    """Only the vision tower + projector of a LLaVA checkpoint (an encode instance): the loader
    skips every decoder tensor (lazy slices, never read), so no decoder weight is in memory."""

    is_multimodal = True
    CHECKPOINT_RENAMES = _CHECKPOINT_RENAMES

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.vision_config = load_llava_vision_config(config.model_path)
        dtype = torch_dtype(config.dtype)
        self.vision_tower = CLIPVisionTower(self.vision_config, dtype)
        self.multi_modal_projector = LlavaProjector(self.vision_config, dtype)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(N, C, S, S) -> (N, num_image_tokens, hidden) in the model dtype."""
        return self.multi_modal_projector(self.vision_tower(pixel_values))


def load_llava_encoder(config: ModelConfig, device: str | torch.device = "cpu") -> LlavaEncoder:
    from pdcluster.models.loader import load_weights

    with torch.device(device):
        encoder = LlavaEncoder(config)
    load_weights(encoder, config.model_path)
    return encoder.eval()


class LlavaForConditionalGeneration(DecoderForCausalLM):
    is_multimodal = True
    CHECKPOINT_RENAMES = _CHECKPOINT_RENAMES

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend, ops_backend: str = "torch",
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        if tp_size > 1:
            raise ValueError("LlavaForConditionalGeneration does not support tensor_parallel_size > 1 yet")
        # As Qwen2ForCausalLM: a Qwen2 decoder has q/k/v bias but none on o_proj.
        object.__setattr__(self, "O_PROJ_FOLLOWS_ATTENTION_BIAS", config.model_type != "qwen2")
        super().__init__(config, attn_backend, ops_backend, tp_rank, tp_size)
        self.vision_config = load_llava_vision_config(config.model_path)
        dtype = torch_dtype(config.dtype)
        self.vision_tower = CLIPVisionTower(self.vision_config, dtype)
        self.multi_modal_projector = LlavaProjector(self.vision_config, dtype)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(N, C, S, S) -> (N, num_image_tokens, hidden) in the model dtype."""
        return self.multi_modal_projector(self.vision_tower(pixel_values))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Any,
                attn_meta: AttentionMetadata, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        if inputs_embeds is None:
            return self.model(input_ids, positions, kv_caches, attn_meta)
        hidden, residual = inputs_embeds, None
        for i, layer in enumerate(self.model.layers):
            hidden, residual = layer(positions, hidden, residual, kv_caches[i], attn_meta)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden
