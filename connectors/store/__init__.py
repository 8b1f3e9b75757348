"""pdcluster.connectors.store: the KV store connector (registry name "store") and StoreLayout.

    StoreLayout      shards, physical layouts and keys shared by every instance of any TP size
    StoreBackend     the port to an object store: the built-in kvstore or Mooncake Store
    StoreConnector   the KV connector over them

Importing the package imports neither torch nor a backend: the connector and the backends load
on first use (the router and `pdcluster --help` import only the layout).
"""

from __future__ import annotations

import importlib
from typing import Any

from .layout import LAYOUTS, ShardSlice, StoreLayout, default_store_tp_size

_LAZY = {
    "StoreConnector": "connector", "StoreOptions": "options", "StoreConnectorMetadata": "meta",
    "StoreBackend": "backend", "StoreBackendError": "backend", "PutResult": "backend", "make_backend": "backend_factory",
    "KVStoreBackend": "kvstore_backend", "MooncakeBackend": "mooncake_backend",
    "mooncake_available": "mooncake_backend",
}

__all__ = [  # the layout names, then the lazily imported ones
    "LAYOUTS", "ShardSlice", "StoreLayout", "default_store_tp_size", *sorted(_LAZY),
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
