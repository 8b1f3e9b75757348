"""`ModelConfig` and its loader: a local HF checkpoint's config.json read into a frozen dataclass.

Pure Python (json only, no torch): `EngineArgs.create_engine_config()` calls it in processes that
must start fast. Both rope spellings are accepted:

    transformers < 5:  "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8, ...}
    transformers >= 5: "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8, ...}
"""

from __future__ import annotations

import json
import logging
import math
import pathlib
from dataclasses import dataclass
from typing import Any

from pdcluster.dtypes import SUPPORTED_DTYPES
from pdcluster.models.hf_layers import layer_use_rope, layer_windows, moe_fields
from pdcluster.models.llava_config import LLAVA_ARCHITECTURE, is_llava, text_config_of

logger = logging.getLogger(__name__)

# architecture -> (model_type, qkv bias forced on, q/k norm per head)
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, bool, bool]] = {
    "LlamaForCausalLM": ("llama", False, False),
    "MistralForCausalLM": ("mistral", False, False),
    "Qwen2ForCausalLM": ("qwen2", True, False),
    "Qwen3ForCausalLM": ("qwen3", False, True),
    "SmolLM3ForCausalLM": ("smollm3", False, False),
    "MixtralForCausalLM": ("mixtral", False, False),
    "Qwen2MoeForCausalLM": ("qwen2_moe", False, False),  # q/k/v bias from its `qkv_bias` (default on)
    "Qwen3MoeForCausalLM": ("qwen3_moe", False, True),
    "Phi3ForCausalLM": ("phi3", False, False),  # fused qkv/gate_up in the checkpoint (loader.py)
    "GraniteForCausalLM": ("granite", False, False),  # Llama with four multipliers (ModelConfig)
}
# What transformers assumes when a config.json leaves a field out, where it differs from ours.
_DEFAULT_ROPE_THETA = {"smollm3": 2000000.0, "mixtral": 1000000.0}
_DEFAULT_TIED = {"smollm3": True}
# The model types whose transformers MLP reads `mlp_bias` (the others build bias-free MLPs whatever
# config.json says, so a stray `mlp_bias` there means nothing to transformers and nothing here).
_MLP_BIAS_TYPES = ("llama", "smollm3", "granite")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "mscale",
              "mscale_all_dim", "truncate")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture facts read from a HF `config.json` (load_model_config below)."""

    model_path: str
    architecture: str  # e.g. "LlamaForCausalLM"
    model_type: str  # e.g. "llama"
    dtype: str  # resolved: one of SUPPORTED_DTYPES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    max_model_len: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    mlp_bias: bool = False  # Llama / SmolLM3 `mlp_bias`: bias on gate, up and down projections
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # frozen items of the HF dict
    partial_rotary_factor: float = 1.0
    rope_is_neox_style: bool = True
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None  # the widest window of any layer (None: no layer slides)
    # Per-layer facts (hf_layers.py); () means "the same for every layer": rope on, no window.
    layer_use_rope: tuple[bool, ...] = ()
    layer_windows: tuple[int, ...] = ()  # tokens; 0 = full causal attention
    # Sparse MoE (hf_layers.MoEFields); num_experts 0 = dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    layer_moe: tuple[bool, ...] = ()
    # Experts partitioned across the TP ranks instead of split (EngineArgs.enable_expert_parallel).
    expert_parallel: bool = False
    # Granite's multipliers: embeddings x embedding_multiplier, each block's output x
    # residual_multiplier before it joins the residual stream, attention_multiplier as the softmax
    # scale (None: 1/sqrt(head_dim)), logits / logits_scaling.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # What the checkpoint (or the user's `dtype`) asked for, when the engine computes in another
    # dtype (see EngineArgs.compute_dtype); None when `dtype` is what was asked.
    requested_dtype: str | None = None

    def __post_init__(self) -> None:
        # A config sent between processes (msgpack) comes back with lists: keep it hashable.
        for name in ("eos_token_ids", "layer_use_rope", "layer_windows", "layer_moe"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.rope_scaling is not None:  # longrope's factor lists too
            object.__setattr__(self, "rope_scaling", tuple(
                (k, tuple(v) if isinstance(v, list) else v) for k, v in self.rope_scaling))

    def uses_rope(self, layer: int) -> bool:
        """Layer `layer` rotates q/k: not a NoPE layer and a rotary dimension above 0."""
        return self.rotary_dim > 0 and (not self.layer_use_rope or self.layer_use_rope[layer])

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window in tokens, or None for full causal attention."""
        return (self.layer_windows[layer] or None) if self.layer_windows else None

    @property
    def kv_window(self) -> int | None:
        """The window every layer's reads fit in: the widest window when every layer slides, else
        None (a full-attention layer reads every position, so no block can ever be freed)."""
        windows = self.layer_windows
        return max(windows) if windows and all(windows) else None

    def is_moe(self, layer: int) -> bool:
        return bool(self.layer_moe) and self.layer_moe[layer]

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling is not None else None

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


def load_model_config(path: str, dtype: str = "auto", max_model_len: int | None = None) -> ModelConfig:
    """Parse `path/config.json` (+ generation_config.json) and validate what the engine supports."""
    root = pathlib.Path(path)
    cfg_file = root / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"config.json not found in model directory {str(root)!r}")
    raw: dict[str, Any] = json.loads(cfg_file.read_text())
    check_weights_exist(root)
    _refuse_quantized(raw)
    outer_arch = None
    if is_llava(raw):  # a LLaVA wrapper: the decoder is its text_config (llava_config.py)
        outer_arch, raw = LLAVA_ARCHITECTURE, text_config_of(raw)
        _refuse_quantized(raw)
    arch = _architecture(raw)
    model_type, force_qkv_bias, qk_norm = SUPPORTED_ARCHITECTURES[arch]
    num_layers = _required_int(raw, "num_hidden_layers")
    mlp_bias = model_type in _MLP_BIAS_TYPES and bool(raw.get("mlp_bias"))
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"hidden_act {hidden_act!r} is not supported; supported: ['silu']")
    num_heads = _required_int(raw, "num_attention_heads")
    hidden = _required_int(raw, "hidden_size")
    max_pos = int(raw.get("max_position_embeddings", 2048))
    rope_theta, rope_scaling, partial = _rope(raw, max_pos, _DEFAULT_ROPE_THETA.get(model_type, 10000.0),
                                              model_type)
    head_dim = int(raw.get("head_dim") or hidden // num_heads)
    max_len = _resolve_max_model_len(max_model_len, max_pos)
    use_rope = layer_use_rope(raw, model_type, num_layers)
    windows = layer_windows(raw, model_type, num_layers, use_rope)
    moe = moe_fields(raw, model_type, num_layers)
    qkv_bias = bool(raw.get("qkv_bias", True)) if model_type == "qwen2_moe" else bool(raw.get("attention_bias"))
    return ModelConfig(
        model_path=str(root),
        architecture=outer_arch or arch,
        model_type=model_type,
        dtype=_resolve_dtype(raw, dtype),
        vocab_size=_required_int(raw, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_required_int(raw, "intermediate_size"),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        max_position_embeddings=max_pos,
        max_model_len=max_len,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", _DEFAULT_TIED.get(model_type, False))),
        attention_bias=force_qkv_bias or qkv_bias,
        mlp_bias=mlp_bias,
        qk_norm=qk_norm,
        rope_scaling=_choose_longrope(rope_scaling, max_len, int(head_dim * partial)),
        partial_rotary_factor=partial,
        hidden_act=hidden_act,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_token_ids(raw, root),
        sliding_window=max(windows) if windows else None,
        layer_use_rope=use_rope,
        layer_windows=windows,
        num_experts=moe.num_experts,
        num_experts_per_tok=moe.num_experts_per_tok,
        moe_intermediate_size=moe.moe_intermediate_size,
        norm_topk_prob=moe.norm_topk_prob,
        shared_expert_intermediate_size=moe.shared_expert_intermediate_size,
        layer_moe=moe.layer_moe,
        **_multipliers(raw, model_type),
    )


def _positive_number(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def _multipliers(raw: dict[str, Any], model_type: str) -> dict[str, float]:
    """Granite's multipliers (transformers' defaults: 1.0 each, the attention one included)."""
    if model_type != "granite":
        return {}
    out = {}
    for key in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"):
        v = raw.get(key, 1.0)
        if not _positive_number(v):
            raise ValueError(f"{key} must be a positive number, got {v!r}")
        out[key] = float(v)
    return out


def _required_int(raw: dict[str, Any], key: str) -> int:
    if key not in raw:
        raise ValueError(f"config.json is missing required field {key!r}")
    return int(raw[key])


def check_weights_exist(root: pathlib.Path) -> None:
    if (root / "model.safetensors.index.json").is_file() or any(root.glob("*.safetensors")):
        return
    raise FileNotFoundError(
        f"no safetensors weights in {str(root)!r}: expected model.safetensors, "
        f"model.safetensors.index.json or *.safetensors (other weight formats are not supported)")


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    raise ValueError(f"unsupported architecture {archs!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}")


def _refuse_quantized(raw: dict[str, Any]) -> None:
    """A quantized checkpoint's weights are codes plus scales: read as plain weights they would give
    wrong tokens with an OK status, so it is refused by name rather than loaded."""
    for key in ("quantization_config", "compression_config"):
        q = raw.get(key)
        if q:
            method = (q.get("quant_method") or q.get("format")) if isinstance(q, dict) else None
            raise ValueError(f"{key} (quant_method={method!r}) is not supported: pdcluster loads unquantized "
                             f"float32/bfloat16/float16 safetensors; use the unquantized checkpoint")


def _resolve_dtype(raw: dict[str, Any], dtype: str) -> str:
    if dtype == "auto":
        found = raw.get("torch_dtype") or raw.get("dtype") or "float32"
        if found not in SUPPORTED_DTYPES:
            raise ValueError(f"checkpoint dtype {found!r} is not supported; pass dtype= one of {SUPPORTED_DTYPES}")
        return found
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {SUPPORTED_DTYPES}, got {dtype!r}")
    return dtype


def _rope(raw: dict[str, Any], max_pos: int, default_theta: float, model_type: str = "llama"
          ) -> tuple[float, tuple[tuple[str, Any], ...] | None, float]:
    """-> (rope_theta, frozen scaling items or None for plain rope, partial_rotary_factor)."""
    params = dict(raw.get("rope_scaling") or {})
    params.update(raw.get("rope_parameters") or {})  # the transformers 5 spelling wins
    theta = float(params.pop("rope_theta", raw.get("rope_theta", default_theta)))
    partial = float(params.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if model_type == "phi3" and rope_type in ("su", "yarn"):  # Phi-3's older spellings, as transformers reads them
        rope_type = "longrope"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {list(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return theta, None, partial
    if rope_type == "dynamic":
        # Dynamic NTK (transformers' dynamic_rope_update) rescales the base only once a sequence
        # outgrows max_position_embeddings, and max_model_len never exceeds that here
        # (_resolve_max_model_len), so every position rotates as plain rope does, exactly.
        factor = params.get("factor")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor < 1:
            raise ValueError(f"dynamic rope scaling: factor must be a number >= 1, got {factor!r}")
        return theta, None, partial
    if "original_max_position_embeddings" in raw:  # a top-level field (Phi-3 style) wins, as in transformers
        params["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
    if rope_type == "yarn":
        return theta, _yarn_items(params, max_pos), partial
    if rope_type == "longrope":
        return theta, _longrope_items(params, max_pos), partial
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings", max_pos)
        missing = [k for k in _LLAMA3_KEYS if k not in params]
        if missing:
            raise ValueError(f"llama3 rope scaling is missing {missing}")
    elif "factor" not in params:
        raise ValueError(f"{rope_type} rope scaling is missing 'factor'")
    items = {"rope_type": rope_type, **{k: params[k] for k in params if k in _LLAMA3_KEYS}}
    return theta, tuple(sorted(items.items())), partial


def _yarn_items(params: dict[str, Any], max_pos: int) -> tuple[tuple[str, Any], ...]:
    """Checked YaRN parameters (factor required, as transformers requires it)."""
    old = params.setdefault("original_max_position_embeddings", max_pos)
    if isinstance(old, bool) or not isinstance(old, int) or old < 1:
        raise ValueError(f"yarn rope scaling: original_max_position_embeddings must be a positive integer, got {old!r}")
    if params.get("factor") is None:
        raise ValueError("yarn rope scaling is missing 'factor'")
    for key in ("factor", "beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"):
        v = params.get(key)
        if v is not None and not _positive_number(v):
            raise ValueError(f"yarn rope scaling: {key} must be a positive number, got {v!r}")
    if params["factor"] < 1:
        raise ValueError(f"yarn rope scaling: factor must be >= 1, got {params['factor']!r}")
    if not isinstance(params.get("truncate", True), bool):
        raise ValueError(f"yarn rope scaling: truncate must be true or false, got {params['truncate']!r}")
    items = {"rope_type": "yarn", **{k: params[k] for k in _YARN_KEYS if params.get(k) is not None}}
    return tuple(sorted(items.items()))


def _longrope_items(params: dict[str, Any], max_pos: int) -> tuple[tuple[str, Any], ...]:
    """Checked LongRoPE parameters (Phi-3 128k, Phi-3.5, Phi-4-mini). The factor set (short or
    long) is chosen once, in load_model_config, from max_model_len (see there)."""
    old = params.setdefault("original_max_position_embeddings", max_pos)
    if isinstance(old, bool) or not isinstance(old, int) or old < 1:
        raise ValueError(f"longrope rope scaling: original_max_position_embeddings must be a positive integer, "
                         f"got {old!r}")
    for key in ("short_factor", "long_factor"):
        v = params.get(key)
        if not isinstance(v, list) or not v or not all(_positive_number(x) for x in v):
            raise ValueError(f"longrope rope scaling: {key} must be a list of positive numbers, got {v!r}")
    for key in ("factor", "attention_factor"):
        v = params.get(key)
        if v is not None and not _positive_number(v):
            raise ValueError(f"longrope rope scaling: {key} must be a positive number, got {v!r}")
    factor = params.get("factor") or max_pos / old  # transformers' default, as its init computes it
    items = {"rope_type": "longrope", "short_factor": tuple(params["short_factor"]),
             "long_factor": tuple(params["long_factor"]), "factor": factor, "original_max_position_embeddings": old}
    if params.get("attention_factor") is not None:
        items["attention_factor"] = params["attention_factor"]
    return tuple(sorted(items.items()))


def _choose_longrope(scaling: tuple[tuple[str, Any], ...] | None, max_model_len: int, rotary_dim: int
                     ) -> tuple[tuple[str, Any], ...] | None:
    """LongRoPE's factor set, fixed for the engine: transformers picks per forward (long once the
    sequence passes original_max_position_embeddings, short before, with the cache rotated by
    whichever set was current). A context that fits the original length uses the short set, as
    transformers does for every such sequence; a longer context uses the long set throughout,
    which equals transformers for prompts past the original length (vLLM's choice is per batch)."""
    items = dict(scaling or ())
    if items.get("rope_type") != "longrope":
        return scaling
    for key in ("short_factor", "long_factor"):
        if len(items[key]) != rotary_dim // 2:
            raise ValueError(f"longrope rope scaling: {key} has {len(items[key])} entries; the rotary dimension "
                             f"{rotary_dim} needs {rotary_dim // 2}")
    long = max_model_len > items["original_max_position_embeddings"]
    if long:
        logger.info("longrope: max_model_len %d > original_max_position_embeddings %d: the long factors rotate every "
                    "position (transformers uses the short ones until a sequence passes the original length; "
                    "--max-model-len %d keeps the short ones)", max_model_len,
                    items["original_max_position_embeddings"], items["original_max_position_embeddings"])
    items["use_long"] = long
    return tuple(sorted(items.items()))


def _resolve_max_model_len(requested: int | None, max_pos: int) -> int:
    # Sliding windows do not bound it: the attention backends mask the window.
    if requested is None:
        return max_pos
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        raise ValueError(f"max_model_len must be a positive integer, got {requested!r}")
    if requested > max_pos:
        raise ValueError(f"max_model_len ({requested}) exceeds the model's max_position_embeddings ({max_pos})")
    return requested


def _eos_token_ids(raw: dict[str, Any], root: pathlib.Path) -> tuple[int, ...]:
    ids: list[int] = []
    sources = [raw]
    gen_file = root / "generation_config.json"
    if gen_file.is_file():
        sources.append(json.loads(gen_file.read_text()))
    for src in sources:
        eos = src.get("eos_token_id")
        for tok in eos if isinstance(eos, list) else [eos]:
            if isinstance(tok, int) and tok not in ids:
                ids.append(tok)
    return tuple(ids)
