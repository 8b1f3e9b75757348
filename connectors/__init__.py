"""pdcluster.connectors: KV connector adapters (p2p, store, ec), the registry, and the contract
re-exported for plugin authors.

A plugin implements `KVConnector` (the ABC in pdcluster/engine/kv_connector.py; DESIGN.md
section 5), takes `(role, engine_config, options)` in its constructor, registers itself under the
`pdcluster.kv_connectors` entry-point group, and runs `pdcluster.connectors.testing`
(ConnectorConformance) on itself with pytest. See examples/connector_plugin.
"""

from __future__ import annotations

from pdcluster.engine.block_pool import KVEvent
from pdcluster.engine.kv_connector import (
    KVCacheLayout,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    KVTransferFailure,
)
from pdcluster.engine.outputs import SchedulerOutput
from pdcluster.engine.request import Request, RequestStatus

from .registry import (
    BUILTIN_CONNECTORS,
    CONNECTORS,
    ENTRY_POINT_GROUP,
    available_connectors,
    create_connector,
    engine_connector_factory,
    resolve_connector_class,
)

KVConnector = KVConnectorBase  # the name plugin authors see

__all__ = [
    "BUILTIN_CONNECTORS", "CONNECTORS", "ENTRY_POINT_GROUP", "KVCacheLayout", "KVConnector", "KVConnectorBase",
    "KVConnectorMetadata", "KVConnectorRole", "KVEvent", "KVTransferFailure", "Request", "RequestStatus",
    "SchedulerOutput", "available_connectors", "create_connector", "engine_connector_factory",
    "resolve_connector_class",
]
