"""The store backends by name: a `Registry` of StoreBackend classes, and `make_backend`.

    kvstore    the built-in store (pdcluster.kvstore; `pdcluster kvstore master|node`), the default
    mooncake   Mooncake Store (`MooncakeDistributedStore`, optional extra `pdcluster[mooncake]`)

The built-ins are lazy "module:Class" strings, so naming a backend imports nothing until it is
built (the Mooncake module imports `mooncake` only when a MooncakeBackend is constructed). The
set is closed, like the connector options that name it: an unknown name is a ValueError that
lists the backends that exist. This module sits above the port (backend.py) and the backends,
which import only the port.
"""

from __future__ import annotations

from typing import Any

from pdcluster.registry import Registry

from .backend import StoreBackend

BUILTIN_BACKENDS: dict[str, str] = {
    "kvstore": "pdcluster.connectors.store.kvstore_backend:KVStoreBackend",
    "mooncake": "pdcluster.connectors.store.mooncake_backend:MooncakeBackend",
}
BACKENDS = tuple(BUILTIN_BACKENDS)  # the names the connector's options accept (options.py)


def _backend_class(obj: object) -> type[StoreBackend]:
    if not (isinstance(obj, type) and issubclass(obj, StoreBackend)):
        raise ValueError("not a StoreBackend subclass")
    return obj


def _build_registry() -> Registry[type[StoreBackend]]:
    registry: Registry[type[StoreBackend]] = Registry("store backend", check=_backend_class, allow_dotted=False)
    for name, path in BUILTIN_BACKENDS.items():
        registry.register(name, path)
    return registry


STORE_BACKENDS = _build_registry()


def make_backend(name: str, options: dict[str, Any]) -> StoreBackend:
    """Build backend `name` from the connector's backend options (see options.py)."""
    return STORE_BACKENDS.get(name).from_options(options)


__all__ = ["BACKENDS", "BUILTIN_BACKENDS", "STORE_BACKENDS", "make_backend"]
