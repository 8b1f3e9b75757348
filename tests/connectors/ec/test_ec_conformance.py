"""The EC connector conformance kit (pdcluster.connectors.testing.ECConnectorConformance) run
against the built-in p2p_ec: real CURVE keys (a `keys init`-style folder made in the run's
workdir), real sockets on 127.0.0.1, shared memory between the two instances."""

from __future__ import annotations

import pathlib
from dataclasses import replace
from typing import Any

import pytest

from pdcluster.connectors.ec import P2PECConnector
from pdcluster.connectors.ec.testing import ECConformanceEnv
from pdcluster.connectors.testing import ECConnectorConformance
from pdcluster.engine.ec_transfer_params import ECItemRef, ECTransferParams
from pdcluster.security.keys import ensure_instance_keys


class TestP2PECConformance(ECConnectorConformance):
    connector_name = "p2p_ec"
    lease_options = {"lease_s": 0.5}
    not_ready_stat = "producer_not_ready"
    short_fetch_options = {"fetch_timeout_s": 0.5}

    def make_options(self, role: str, workdir: pathlib.Path) -> dict[str, Any]:
        keys = workdir / "keys"
        ensure_instance_keys(keys, ["producer", "consumer"])  # the allow-list: every public key there
        return {"keys_dir": str(keys), "key_name": role, "role": role, "host": "127.0.0.1"}


class AnnouncesPending(P2PECConnector):
    """Broken on purpose: announces what it was asked about, servable or not (the peer's race)."""

    def request_finished(self, request_id: str, mm_hashes: list[str]) -> ECTransferParams | None:
        params = super().request_finished(request_id, mm_hashes)
        if params is None:
            return None
        return replace(params, items=tuple(ECItemRef(h) for h in dict.fromkeys(mm_hashes)))


class _Broken(TestP2PECConformance):
    connector_name = "test_ec_conformance:AnnouncesPending"


def test_the_kit_catches_a_connector_that_announces_pending_items(tmp_path: pathlib.Path) -> None:
    kit = _Broken()
    env = ECConformanceEnv(kit, tmp_path)
    try:
        with pytest.raises(AssertionError, match="only READY items may be announced"):
            kit.test_item_states_and_announce_only_when_servable(env)
    finally:
        env.close()
