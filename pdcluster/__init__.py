"""pdcluster: disaggregated prefill/decode LLM serving.

Public names are imported lazily so `import pdcluster` (the router, the CLI, the client) does not
pay for torch.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "LLM": "pdcluster.engine.llm",
    "AsyncEngine": "pdcluster.engine.async_engine",
    "SamplingParams": "pdcluster.sampling_params",
    "RequestOutput": "pdcluster.engine.outputs",
    "CompletionOutput": "pdcluster.engine.outputs",
    "EngineArgs": "pdcluster.config",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pdcluster' has no attribute {name!r}")
