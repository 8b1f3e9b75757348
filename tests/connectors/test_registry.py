"""The KV-connector lookup is the generic Registry: built-ins, dotted paths, the entry-point
group, and errors that name what exists (the plugin path is covered by test_example_plugin)."""

from __future__ import annotations

import pytest

from pdcluster.connectors import (
    BUILTIN_CONNECTORS,
    CONNECTORS,
    ENTRY_POINT_GROUP,
    available_connectors,
    resolve_connector_class,
)
from pdcluster.registry import Registry


def test_connectors_are_one_registry_of_the_builtins() -> None:
    assert isinstance(CONNECTORS, Registry) and CONNECTORS.entry_point_group == ENTRY_POINT_GROUP
    assert {name: available_connectors()[name] for name in BUILTIN_CONNECTORS} == BUILTIN_CONNECTORS
    assert resolve_connector_class("store").__name__ == "StoreConnector"


def test_errors_name_the_field_the_sources_and_the_refusal() -> None:
    with pytest.raises(ValueError, match="kv_connector must be a non-empty string"):
        resolve_connector_class("")
    with pytest.raises(ValueError, match=r"unknown KV connector 'nope'; available: .*p2p \(pdcluster\.connectors\."
                                         r"p2p:P2PConnector\).*'pdcluster\.kv_connectors' entry point"):
        resolve_connector_class("nope")
    with pytest.raises(ValueError, match="refused: not a KVConnectorBase subclass"):
        resolve_connector_class("pdcluster.connectors.registry:available_connectors")
