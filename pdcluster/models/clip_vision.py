"""The CLIP vision tower (ViT) of a LLaVA checkpoint, numerically as transformers' CLIPVisionModel.

    pixels (N, C, S, S) -> patch conv (no bias) -> [CLS | patches] + position embedding
        -> pre_layrnorm = hidden_states[0] -> encoder layer i -> hidden_states[i + 1]

Only the layers up to the deepest `vision_feature_layer` are built and run (LLaVA reads the
second-to-last layer by default, so the last layer and post_layernorm are never needed; their
checkpoint tensors are ignored by the loader). Weights are replicated on every TP rank.
Parameter names follow the checkpoint (`vision_tower.embeddings...`, `encoder.layers.<i>...`)
except q/k/v, fused into `qkv_proj` by the loader's STACKED_PARAMS like the decoder's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pdcluster.models.layers.linear import QKVParallelLinear, ReplicatedLinear
from pdcluster.models.layers.weight_slice import Loaded, whole
from pdcluster.models.llava_config import LlavaVisionConfig


def replicated_param(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    """A parameter the loader fills with the whole checkpoint tensor (shape checked)."""
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)

    def load(param: nn.Parameter, loaded: Loaded, shard_id: object = None) -> None:
        src = whole(loaded)
        if tuple(src.shape) != tuple(param.shape):
            raise ValueError(f"checkpoint tensor has shape {tuple(src.shape)}, expected {tuple(param.shape)}")
        param.data.copy_(src)

    p.weight_loader = load  # type: ignore[attr-defined]
    return p


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = replicated_param((dim,), dtype)
        self.bias = replicated_param((dim,), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """transformers' ACT2FN entries a CLIP tower or LLaVA projector names (llava_config.ACTIVATIONS),
    each computed as transformers computes it."""
    if name == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    if name == "gelu":
        return F.gelu(x)
    if name == "gelu_pytorch_tanh":
        return F.gelu(x, approximate="tanh")
    if name == "gelu_new":  # transformers' NewGELUActivation: the tanh form, written out
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    if name in ("silu", "swish"):
        return F.silu(x)
    if name == "relu":
        return F.relu(x)
    raise ValueError(f"activation {name!r} is not supported")


class CLIPEmbeddings(nn.Module):
    def __init__(self, cfg: LlavaVisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.patch_size, self.image_size = cfg.patch_size, cfg.image_size
        self.class_embedding = replicated_param((cfg.hidden_size,), dtype)
        self.patch_embedding = nn.Module()
        self.patch_embedding.weight = replicated_param(
            (cfg.hidden_size, cfg.num_channels, cfg.patch_size, cfg.patch_size), dtype)
        self.position_embedding = nn.Module()
        self.position_embedding.weight = replicated_param((cfg.num_patches + 1, cfg.hidden_size), dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        n, _, h, w = pixel_values.shape
        if h != self.image_size or w != self.image_size:
            raise ValueError(f"pixel values are {h}x{w}; the vision tower takes {self.image_size}x{self.image_size}")
        weight = self.patch_embedding.weight
        patches = F.conv2d(pixel_values.to(weight.dtype), weight, stride=self.patch_size)  # (N, E, g, g)
        patches = patches.flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(n, 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight.unsqueeze(0)


class CLIPAttention(nn.Module):
    def __init__(self, cfg: LlavaVisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, self.num_heads, self.num_heads, True, dtype)
        self.out_proj = ReplicatedLinear(cfg.hidden_size, cfg.hidden_size, True, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, e = x.shape
        q, k, v = self.qkv_proj(x).view(n, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim ** -0.5)  # no mask: bidirectional
        return self.out_proj(out.transpose(1, 2).reshape(n, t, e))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, cfg: LlavaVisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.act = cfg.hidden_act
        self.layer_norm1 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype)
        self.self_attn = CLIPAttention(cfg, dtype)
        self.layer_norm2 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype)
        self.mlp = nn.Module()
        self.mlp.fc1 = ReplicatedLinear(cfg.hidden_size, cfg.intermediate_size, True, dtype)
        self.mlp.fc2 = ReplicatedLinear(cfg.intermediate_size, cfg.hidden_size, True, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        h = self.mlp.fc2(activation(self.act, self.mlp.fc1(self.layer_norm2(x))))
        return x + h


class CLIPVisionTower(nn.Module):
    def __init__(self, cfg: LlavaVisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        self.feature_layers = cfg.resolved_layers()
        self.embeddings = CLIPEmbeddings(cfg, dtype)
        self.pre_layrnorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(CLIPEncoderLayer(cfg, dtype) for _ in range(max(self.feature_layers)))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(N, C, S, S) -> the selected features (N, P, E * len(feature_layers)); P drops CLS under
        the "default" strategy."""
        hidden = self.pre_layrnorm(self.embeddings(pixel_values))
        states = [hidden]
        for layer in self.encoder.layers:
            hidden = layer(hidden)
            states.append(hidden)
        picked = [states[i] for i in self.feature_layers]
        if self.cfg.select_strategy == "default":
            picked = [s[:, 1:] for s in picked]
        return picked[0] if len(picked) == 1 else torch.cat(picked, dim=-1)
