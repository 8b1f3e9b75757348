"""Architecture name -> model class, and model path resolution.

Model classes are imported on first use (PEP 562 module `__getattr__`) so that resolving a path
or reading a config does not import torch.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

# HF `architectures` entry -> "module:Class" implementing it.
_ARCHITECTURE_PATHS: dict[str, str] = {
    "LlamaForCausalLM": "pdcluster.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "pdcluster.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "pdcluster.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "pdcluster.models.qwen3:Qwen3ForCausalLM",
}


def _load(path: str) -> type:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def __getattr__(name: str) -> Any:
    if name == "ARCHITECTURES":  # dict[str, type], built on access
        return {arch: _load(path) for arch, path in _ARCHITECTURE_PATHS.items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURE_PATHS)


def get_model_class(arch: str) -> type:
    if arch not in _ARCHITECTURE_PATHS:
        raise ValueError(f"unsupported architecture {arch!r}; supported: {supported_architectures()}")
    return _load(_ARCHITECTURE_PATHS[arch])


def resolve_model_path(model: str | None) -> str:
    """None -> the built-in demo model (written on first use); otherwise an existing local dir."""
    if model is None:
        from pdcluster.models.demo import ensure_demo_model  # lazy: writes files on first call

        return ensure_demo_model()
    path = os.path.expanduser(model)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {model!r} does not exist (only local HF checkpoint dirs are supported)")
    return path
