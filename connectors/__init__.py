"""pdcluster.connectors: KV connector adapters (p2p, store, ec), the registry, and the contract
re-exported for plugin authors.

A plugin implements `KVConnector` (the ABC in pdcluster/engine/kv_connector.py; DESIGN.md
section 5), takes `(role, engine_config, options)` in its constructor, registers itself under the
`pdcluster.kv_connectors` entry-point group, and runs `pdcluster.connectors.testing`
(ConnectorConformance) on itself with pytest. See examples/connector_plugin.

The hand-off between the legs is a `KVTransferParams` (frozen, validated when built): a request's
leg is `request.kv_transfer_params` (do_remote_decode on the prefill leg, do_remote_prefill on the
decode leg, None for a local request), and a producer's `request_finished` returns the params the
decode leg will get. Use the common fields (connector, producer_id, engine_epoch, request_id,
transfer_id, lease_id, lease_expiry_time, num_tokens, block_ids or store_keys, ...) for what they
say; put what is your connector's own in `extra`, a map of at most 32 entries (keys like
`myconn_path`, values str, bytes, int, float, bool or a list of those, 4 KiB each, 16 KiB in
all). A router carries the params as the proto KvTransferParams (pdcluster.proto_convert), and
extra's values come back with their types. Build a copy with `params.replace(...)`; unknown
fields are refused by name (`KVTransferParams.from_wire`).

An encoder-cache plugin implements `ECConnector` (pdcluster/engine/ec_connector.py), is built the same
way and registers under the `pdcluster.ec_connectors` group (`EC_CONNECTORS`; built-in "p2p_ec");
its hand-off is an `ECTransferParams` (one producer's items by mm_hash, each under a lease). Its
conformance kit is `pdcluster.connectors.testing.ECConnectorConformance` (connectors/ec/testing.py:
item states, announce only when servable, fetch + lease release, NOT_READY vs MISSING, garbage
params failing alone, lease expiry, shutdown leaving nothing; no weights needed).
"""

from __future__ import annotations

from pdcluster.engine.block_pool import KVEvent
from pdcluster.engine.ec_connector import ECConnectorBase, ECConnectorRole, ECTransferParams
from pdcluster.engine.kv_connector import (
    KVCacheLayout,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    KVTransferFailure,
    KVTransferParams,
)
from pdcluster.engine.outputs import SchedulerOutput
from pdcluster.engine.request import Request, RequestStatus

from .registry import (
    BUILTIN_CONNECTORS,
    CONNECTORS,
    EC_CONNECTORS,
    ENTRY_POINT_GROUP,
    available_connectors,
    create_connector,
    create_ec_connector,
    ec_connector_factory,
    engine_connector_factory,
    resolve_connector_class,
)

KVConnector = KVConnectorBase  # the name plugin authors see
ECConnector = ECConnectorBase  # the EC contract (engine/ec_connector.py), group pdcluster.ec_connectors

__all__ = [
    "BUILTIN_CONNECTORS", "CONNECTORS", "EC_CONNECTORS", "ECConnector", "ECConnectorBase", "ECConnectorRole",
    "ECTransferParams", "ENTRY_POINT_GROUP", "create_ec_connector", "ec_connector_factory", "KVCacheLayout", "KVConnector", "KVConnectorBase",
    "KVConnectorMetadata", "KVConnectorRole", "KVEvent", "KVTransferFailure", "KVTransferParams", "Request", "RequestStatus",
    "SchedulerOutput", "available_connectors", "create_connector", "engine_connector_factory",
    "resolve_connector_class",
]
