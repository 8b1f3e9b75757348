"""Find a KV connector class by name and build it for one engine role.

The connectors are one `Registry` (pdcluster/registry.py); a name resolves, in this order:

    "pkg.module:Class"          a dotted path (an operator's config, never request data)
    "p2p"                       a built-in (BUILTIN_CONNECTORS)
    "mine"                      an entry point named "mine" in the group `pdcluster.kv_connectors`
                                (a plugin package's pyproject: [project.entry-points."pdcluster.kv_connectors"])

A connector class is built as `cls(role, engine_config, options)` for each role the engine needs
(KVConnectorRole.SCHEDULER in the engine core, KVConnectorRole.WORKER in every model runner);
`options` is the plain-data dict from EngineArgs.kv_connector_options. The class attribute
`name` (if any) is what the producer writes into kv_transfer_params["connector"].
"""

from __future__ import annotations

from typing import Any

from pdcluster.config import EngineConfig
from pdcluster.engine.ec_connector import ECConnectorBase, ECConnectorRole
from pdcluster.engine.kv_connector import KVConnectorBase, KVConnectorRole
from pdcluster.registry import Registry

ENTRY_POINT_GROUP = "pdcluster.kv_connectors"
BUILTIN_CONNECTORS: dict[str, str] = {
    "p2p": "pdcluster.connectors.p2p:P2PConnector",
    "store": "pdcluster.connectors.store:StoreConnector",
}


def _connector_class(obj: object) -> type[KVConnectorBase]:
    if not (isinstance(obj, type) and issubclass(obj, KVConnectorBase)):
        raise ValueError("not a KVConnectorBase subclass")
    return obj


def _build_registry() -> Registry[type[KVConnectorBase]]:
    registry: Registry[type[KVConnectorBase]] = Registry(
        "KV connector", entry_point_group=ENTRY_POINT_GROUP, check=_connector_class, list_sources=True)
    for name, path in BUILTIN_CONNECTORS.items():
        registry.register(name, path)
    return registry


CONNECTORS = _build_registry()


def available_connectors() -> dict[str, str]:
    """name -> "module:attr" for every built-in and installed plugin (built-ins win a clash)."""
    return CONNECTORS.available()


def resolve_connector_class(name: str) -> type[KVConnectorBase]:
    """The connector class a name stands for; ValueError listing what is available."""
    if not isinstance(name, str) or not name:  # the config field's name, not the registry's
        raise ValueError(f"kv_connector must be a non-empty string, got {name!r}")
    return CONNECTORS.get(name)


def create_connector(name: str, role: KVConnectorRole | str, engine_config: EngineConfig,
                     options: dict[str, Any] | None = None) -> KVConnectorBase:
    """Build connector `name` for `role` ("scheduler" | "worker")."""
    cls = resolve_connector_class(name)
    return cls(KVConnectorRole(role), engine_config, dict(options or {}))


def engine_connector_factory(role: KVConnectorRole, engine_config: EngineConfig) -> KVConnectorBase:
    """The factory services hand the engine (`LLMEngine(config, connector=engine_connector_factory)`):
    builds engine_config.kv_connector with engine_config.kv_connector_options."""
    if not engine_config.kv_connector:
        raise ValueError("engine_config.kv_connector is not set")
    return create_connector(engine_config.kv_connector, role, engine_config, engine_config.kv_connector_options)


# -- EC connectors (pdcluster/engine/ec_connector.py): the same mechanism, their own group --------
EC_ENTRY_POINT_GROUP = "pdcluster.ec_connectors"
BUILTIN_EC_CONNECTORS: dict[str, str] = {
    "p2p_ec": "pdcluster.connectors.ec:P2PECConnector",
}


def _ec_connector_class(obj: object) -> type[ECConnectorBase]:
    if not (isinstance(obj, type) and issubclass(obj, ECConnectorBase)):
        raise ValueError("not an ECConnectorBase subclass")
    return obj


def _build_ec_registry() -> Registry[type[ECConnectorBase]]:
    registry: Registry[type[ECConnectorBase]] = Registry(
        "EC connector", entry_point_group=EC_ENTRY_POINT_GROUP, check=_ec_connector_class, list_sources=True)
    for name, path in BUILTIN_EC_CONNECTORS.items():
        registry.register(name, path)
    return registry


EC_CONNECTORS = _build_ec_registry()


def create_ec_connector(name: str, role: ECConnectorRole | str, engine_config: EngineConfig,
                        options: dict[str, Any] | None = None) -> ECConnectorBase:
    if not isinstance(name, str) or not name:
        raise ValueError(f"ec_connector must be a non-empty string, got {name!r}")
    cls = EC_CONNECTORS.get(name)
    return cls(ECConnectorRole(role), engine_config, dict(options or {}))


def ec_connector_factory(role: ECConnectorRole, engine_config: EngineConfig) -> ECConnectorBase:
    """What services hand the engine (`LLMEngine(config, ec_connector=ec_connector_factory)`): builds
    engine_config.ec_connector with engine_config.ec_connector_options."""
    if not engine_config.ec_connector:
        raise ValueError("engine_config.ec_connector is not set")
    return create_ec_connector(engine_config.ec_connector, role, engine_config, engine_config.ec_connector_options)


__all__ = ["BUILTIN_CONNECTORS", "BUILTIN_EC_CONNECTORS", "CONNECTORS", "EC_CONNECTORS", "EC_ENTRY_POINT_GROUP",
           "ENTRY_POINT_GROUP", "available_connectors", "create_connector", "create_ec_connector",
           "ec_connector_factory", "engine_connector_factory", "resolve_connector_class"]
