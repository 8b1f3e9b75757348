"""EC connectors are found through the same Registry as KV connectors: the built-in p2p_ec, dotted
paths, an unknown name listing what exists, and a wrong kind of object refused by name."""

from __future__ import annotations

import pytest

from pdcluster.connectors import EC_CONNECTORS, ECConnectorBase, create_ec_connector
from pdcluster.connectors.ec import P2PECConnector


def test_builtin_and_dotted_path() -> None:
    assert EC_CONNECTORS.get("p2p_ec") is P2PECConnector
    assert EC_CONNECTORS.get("pdcluster.connectors.ec:P2PECConnector") is P2PECConnector
    assert issubclass(P2PECConnector, ECConnectorBase) and P2PECConnector.name == "p2p_ec"


def test_unknown_and_wrong_kind_refused() -> None:
    with pytest.raises(ValueError, match="p2p_ec"):  # the error lists what exists
        EC_CONNECTORS.get("nope")
    with pytest.raises(ValueError, match="ECConnectorBase"):
        EC_CONNECTORS.get("pdcluster.connectors.p2p:P2PConnector")  # a KV connector is not an EC one
    with pytest.raises(ValueError, match="non-empty"):
        create_ec_connector("", "worker", None)  # type: ignore[arg-type]


def test_options_checked_by_name(llava_path, ec_keys) -> None:
    from pdcluster.config import EngineArgs

    config = EngineArgs(model=llava_path, device="cpu", num_kv_blocks=16).create_engine_config()
    with pytest.raises(ValueError, match="unknown p2p_ec connector option"):
        create_ec_connector("p2p_ec", "worker", config, ec_keys.options("encoder", colour="blue"))
    with pytest.raises(ValueError, match="needs CURVE keys"):
        create_ec_connector("p2p_ec", "worker", config, {"allowed_keys": ec_keys.allowed})
    with pytest.raises(ValueError, match="port"):
        create_ec_connector("p2p_ec", "worker", config, ec_keys.options("encoder", port=70000))
