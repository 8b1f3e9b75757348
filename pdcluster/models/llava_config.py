"""LLaVA checkpoint facts: the decoder's `text_config`, the CLIP `vision_config` and the projector
settings of a HF `LlavaForConditionalGeneration` config.json, read without torch.

`hf_config.load_model_config` parses the decoder from `text_config_of(raw)` (so every decoder
fact, rope, windows and eos included, is read by the same code as a text-only checkpoint) and keeps
`LlavaForConditionalGeneration` as the architecture; the vision side is read here.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
from dataclasses import asdict, dataclass
from typing import Any

LLAVA_ARCHITECTURE = "LlavaForConditionalGeneration"
# text_config.model_type -> the decoder architecture that serves it
_TEXT_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
SELECT_STRATEGIES = ("default", "full")
# transformers' ACT2FN names clip_vision.activation computes (the tower's and the projector's)
ACTIVATIONS = ("quick_gelu", "gelu", "gelu_pytorch_tanh", "gelu_new", "silu", "swish", "relu")
_FINGERPRINT_VERSION = "pdcluster.llava.encoder.v1"


@dataclass(frozen=True)
class LlavaVisionConfig:
    """What the vision tower and projector are, and how an image becomes placeholder tokens."""

    image_size: int
    patch_size: int
    num_channels: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    layer_norm_eps: float
    hidden_act: str
    # vision_feature_layer as in transformers: one index into the tower's hidden states (0 = the
    # embeddings after pre_layrnorm, -1 = the last layer's output) or a list (concatenated).
    feature_layers: tuple[int, ...]
    feature_layer_is_list: bool
    select_strategy: str  # "default" drops the CLS position, "full" keeps it
    image_token_index: int
    text_hidden_size: int
    projector_hidden_act: str = "gelu"
    projector_bias: bool = True

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    def num_image_tokens(self, height: int, width: int) -> int:
        """Placeholders for an image preprocessed to height x width: LlavaProcessor's count with
        the CLIP tower's one extra (CLS) position, minus it under the "default" strategy."""
        n = (height // self.patch_size) * (width // self.patch_size) + 1
        return n - 1 if self.select_strategy == "default" else n

    def resolved_layers(self) -> list[int]:
        """feature layers as non-negative indices into the num_hidden_layers + 1 hidden states."""
        total = self.num_hidden_layers + 1
        out = []
        for i in self.feature_layers:
            j = i + total if i < 0 else i
            if not 0 <= j < total:
                raise ValueError(f"vision_feature_layer {i} is outside the tower's {total} hidden states")
            out.append(j)
        return out

    def fingerprint(self, model_path: str, dtype: str) -> str:
        """Identity of the encoder (tower + projector) that turns pixels into embeddings: two
        engines with equal fingerprints produce interchangeable encoder outputs."""
        blob = json.dumps({"v": _FINGERPRINT_VERSION, "model": str(model_path), "dtype": dtype, **asdict(self)},
                          sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()


def is_llava(raw: dict[str, Any]) -> bool:
    return LLAVA_ARCHITECTURE in (raw.get("architectures") or []) or raw.get("model_type") == "llava"


def text_config_of(raw: dict[str, Any]) -> dict[str, Any]:
    """The decoder's config dict, shaped like a text-only config.json (architectures set)."""
    text = dict(raw.get("text_config") or {})
    model_type = text.get("model_type", "llama")
    if model_type not in _TEXT_ARCHITECTURES:
        raise ValueError(f"LLaVA text_config.model_type {model_type!r} is not supported; "
                         f"supported: {sorted(_TEXT_ARCHITECTURES)}")
    text["architectures"] = [_TEXT_ARCHITECTURES[model_type]]
    for key in ("torch_dtype", "dtype"):  # transformers writes the dtype on the outer config
        if key not in text and key in raw:
            text[key] = raw[key]
    if "tie_word_embeddings" not in text and "tie_word_embeddings" in raw:
        text["tie_word_embeddings"] = raw["tie_word_embeddings"]
    return text


def load_llava_vision_config(path: str | pathlib.Path) -> LlavaVisionConfig:
    raw: dict[str, Any] = json.loads((pathlib.Path(path) / "config.json").read_text())
    if not is_llava(raw):
        raise ValueError(f"{str(path)!r} is not a LLaVA checkpoint (architectures {raw.get('architectures')})")
    vision = raw.get("vision_config") or {}
    vtype = vision.get("model_type", "clip_vision_model")
    if vtype != "clip_vision_model":
        raise ValueError(f"LLaVA vision_config.model_type {vtype!r} is not supported; supported: ['clip_vision_model']")
    layer = raw.get("vision_feature_layer", -2)
    layers = tuple(int(x) for x in layer) if isinstance(layer, list) else (int(layer),)
    strategy = raw.get("vision_feature_select_strategy", "default")
    if strategy not in SELECT_STRATEGIES:
        raise ValueError(f"vision_feature_select_strategy {strategy!r} is not supported; supported: {SELECT_STRATEGIES}")
    cfg = LlavaVisionConfig(
        image_size=int(vision.get("image_size", 224)),
        patch_size=int(vision.get("patch_size", 32)),
        num_channels=int(vision.get("num_channels", 3)),
        hidden_size=int(vision.get("hidden_size", 768)),
        intermediate_size=int(vision.get("intermediate_size", 3072)),
        num_hidden_layers=int(vision.get("num_hidden_layers", 12)),
        num_attention_heads=int(vision.get("num_attention_heads", 12)),
        layer_norm_eps=float(vision.get("layer_norm_eps", 1e-5)),
        hidden_act=str(vision.get("hidden_act", "quick_gelu")),
        feature_layers=layers,
        feature_layer_is_list=isinstance(layer, list),
        select_strategy=strategy,
        image_token_index=int(raw.get("image_token_index", raw.get("image_token_id", 32000))),
        text_hidden_size=int((raw.get("text_config") or {}).get("hidden_size", 4096)),
        projector_hidden_act=str(raw.get("projector_hidden_act", "gelu")),
        projector_bias=bool(raw.get("multimodal_projector_bias", True)),
    )
    if cfg.hidden_act not in ACTIVATIONS:
        raise ValueError(f"vision hidden_act {cfg.hidden_act!r} is not supported; supported: {ACTIVATIONS}")
    if cfg.projector_hidden_act not in ACTIVATIONS:
        raise ValueError(f"projector_hidden_act {cfg.projector_hidden_act!r} is not supported; "
                         f"supported: {ACTIVATIONS}")
    cfg.resolved_layers()  # validates the indices
    return cfg
