"""pdcluster.kvstore: a small Mooncake-style distributed object store for KV blocks.

master (metadata, two-phase puts, write arenas, leases, eviction, op log) -- storage nodes (memory
segments served on the pdcluster data plane) -- client (zero-copy put/get into caller buffers).
Entry points: `python -m pdcluster.kvstore.master`, `python -m pdcluster.kvstore.node`, or
`run_master(args)` / `run_node(args)` with `add_master_args` / `add_node_args`.

Names are imported lazily: `python -m pdcluster.kvstore.master` must not import the master
module twice (once via this package, once as __main__), and importers pay only for what they use.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "KVStoreClient": "client", "KVStoreError": "master_rpc", "PendingPut": "client",
    "MasterConfig": "entities", "Status": "entities",
    "MasterServer": "master", "add_master_args": "master", "run_master": "master",
    "StorageNode": "node", "add_node_args": "node", "run_node": "node",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
