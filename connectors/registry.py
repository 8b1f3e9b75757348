"""Find a KV connector class by name and build it for one engine role.

A name resolves, in this order:

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

import importlib
from importlib import metadata
from typing import Any

from pdcluster.config import EngineConfig
from pdcluster.engine.kv_connector import KVConnectorBase, KVConnectorRole

ENTRY_POINT_GROUP = "pdcluster.kv_connectors"
BUILTIN_CONNECTORS: dict[str, str] = {
    "p2p": "pdcluster.connectors.p2p:P2PConnector",
    "store": "pdcluster.connectors.store:StoreConnector",
}


def _entry_points() -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def available_connectors() -> dict[str, str]:
    """name -> "module:attr" for every built-in and installed plugin (built-ins win a clash)."""
    out = {name: ep.value for name, ep in _entry_points().items()}
    out.update(BUILTIN_CONNECTORS)
    return dict(sorted(out.items()))


def _load_dotted(path: str) -> Any:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"connector path {path!r} must look like 'package.module:ClassName'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import connector module {module_name!r}: {e}") from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def resolve_connector_class(name: str) -> type[KVConnectorBase]:
    """The connector class a name stands for; ValueError listing what is available."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"kv_connector must be a non-empty string, got {name!r}")
    if ":" in name:
        cls = _load_dotted(name)
    elif name in BUILTIN_CONNECTORS:
        cls = _load_dotted(BUILTIN_CONNECTORS[name])
    else:
        ep = _entry_points().get(name)
        if ep is None:
            known = ", ".join(f"{n} ({p})" for n, p in available_connectors().items())
            raise ValueError(f"unknown KV connector {name!r}; available: {known or 'none'}; or give a "
                             f"dotted path 'package.module:Class' or install a package with a "
                             f"'{ENTRY_POINT_GROUP}' entry point")
        try:
            cls = ep.load()
        except Exception as e:  # a broken plugin: say which one
            raise ValueError(f"KV connector entry point {name!r} ({ep.value}) failed to load: {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase)):
        raise ValueError(f"KV connector {name!r} resolved to {cls!r}, which is not a KVConnectorBase subclass")
    return cls


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


__all__ = ["BUILTIN_CONNECTORS", "ENTRY_POINT_GROUP", "available_connectors", "create_connector",
           "engine_connector_factory", "resolve_connector_class"]
