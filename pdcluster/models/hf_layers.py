"""Per-layer facts of a HF config (rotary or NoPE, sliding window, MoE or dense MLP), computed the way
the installed transformers computes them in each architecture's configuration/modeling file.

Pure Python (no torch), like hf_config.py which calls it. An explicit `layer_types` list in
config.json (transformers writes one when it saves) wins over the derived default, as in
transformers. Windows follow transformers' mask: a query at position q sees keys k with
q - window < k <= q, i.e. the last `window` tokens including itself.

    sliding layers            mistral, mixtral, phi3, qwen3_moe: every layer when the window is set
                              qwen2, qwen3: i >= max_window_layers     (use_sliding_window)
                              qwen2_moe:    i even and i < max_window_layers (use_sliding_window)
                              smollm3:      the NoPE layers            (use_sliding_window)
    MoE layers                mixtral: all; qwen*_moe: i not in mlp_only_layers and
                              (i + 1) % decoder_sparse_step == 0
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
_SLIDING, _FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class MoEFields:
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0  # qwen2_moe's gated shared expert; 0: none
    layer_moe: tuple[bool, ...] = ()  # per layer: sparse MoE block (True) or dense MLP


def layer_use_rope(raw: dict[str, Any], model_type: str, num_layers: int) -> tuple[bool, ...]:
    """Per layer: does it apply rotary embeddings? () when every layer does."""
    if model_type != "smollm3":
        return ()
    flags = raw.get("no_rope_layers")  # 1 = rope, 0 = NoPE (transformers' naming is inverted)
    if flags is None:
        interval = int(raw.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if len(flags) < num_layers:
        raise ValueError(f"no_rope_layers has {len(flags)} entries for {num_layers} layers")
    return tuple(bool(f) for f in flags[:num_layers])


def layer_windows(raw: dict[str, Any], model_type: str, num_layers: int,
                  use_rope: tuple[bool, ...]) -> tuple[int, ...]:
    """Per layer: its sliding window in tokens, 0 for full causal attention. () when no layer slides."""
    window = raw.get("sliding_window")
    use = bool(raw.get("use_sliding_window", False))
    max_window_layers = int(raw.get("max_window_layers", 28))
    if model_type in ("mistral", "mixtral", "phi3"):
        windows = [int(window or 0)] * num_layers
    elif model_type == "qwen3_moe":
        windows = [int(window or 0) if use else 0] * num_layers
    elif model_type in ("qwen2", "qwen3", "qwen2_moe", "smollm3"):
        active = int(window or 0) if use else 0
        types = raw.get("layer_types") or [_default_type(model_type, i, active, max_window_layers, use_rope)
                                           for i in range(num_layers)]
        if len(types) < num_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
        windows = [active if t == _SLIDING else 0 for t in types[:num_layers]]
    else:
        windows = [0] * num_layers  # llama: no sliding window in transformers' Llama
    if any(w < 0 for w in windows):
        raise ValueError(f"sliding_window must be positive, got {window!r}")
    return tuple(windows) if any(windows) else ()


def _default_type(model_type: str, i: int, window: int, max_window_layers: int,
                  use_rope: tuple[bool, ...]) -> str:
    if not window:
        return _FULL
    if model_type in ("qwen2", "qwen3"):
        return _SLIDING if i >= max_window_layers else _FULL
    if model_type == "qwen2_moe":
        return _SLIDING if (i + 1) % 2 and i < max_window_layers else _FULL
    return _SLIDING if use_rope and not use_rope[i] else _FULL  # smollm3: the NoPE layers slide


def moe_fields(raw: dict[str, Any], model_type: str, num_layers: int) -> MoEFields:
    """The sparse-MoE settings of a MoE architecture (defaults as in its transformers config)."""
    if model_type not in MOE_MODEL_TYPES:
        return MoEFields()
    if model_type == "mixtral":
        experts = int(raw.get("num_local_experts", raw.get("num_experts", 8)))
        return MoEFields(experts, int(raw.get("num_experts_per_tok", 2)), int(raw["intermediate_size"]),
                         True, 0, (True,) * num_layers)
    qwen2 = model_type == "qwen2_moe"
    experts = int(raw.get("num_experts", raw.get("num_local_experts", 60 if qwen2 else 128)))
    top_k = int(raw.get("num_experts_per_tok", 4 if qwen2 else 8))
    inter = int(raw.get("moe_intermediate_size", 1408 if qwen2 else 768))
    shared = int(raw.get("shared_expert_intermediate_size", 5632)) if qwen2 else 0
    step = int(raw.get("decoder_sparse_step", 1))
    mlp_only = set(raw.get("mlp_only_layers") or ())
    layers = tuple(i not in mlp_only and experts > 0 and (i + 1) % step == 0 for i in range(num_layers))
    if experts > 0 and not 1 <= top_k <= experts:
        raise ValueError(f"num_experts_per_tok ({top_k}) must be in [1, num_experts={experts}]")
    return MoEFields(experts, top_k, inter, bool(raw.get("norm_topk_prob", False)), shared, layers)
