"""The conformance kit on the built-in P2P connector (in-process producer and consumers, real
CURVE side channel and TCP data plane on 127.0.0.1)."""

from __future__ import annotations

import pathlib
from typing import Any

from pdcluster.connectors.testing import ConnectorConformance
from pdcluster.security.keys import generate_keypair, keypair_to_string

_PRODUCER, _CONSUMER = generate_keypair("producer"), generate_keypair("consumer")
_ALLOWED = {"producer": _PRODUCER.public.decode(), "consumer": _CONSUMER.public.decode()}


class TestP2PConformance(ConnectorConformance):
    connector_name = "p2p"
    lease_options = {"lease_ttl_s": 2.0}

    def make_options(self, role: str, workdir: pathlib.Path) -> dict[str, Any]:
        kp = _PRODUCER if role == "producer" else _CONSUMER
        return {"keypair": keypair_to_string(kp), "allowed_keys": _ALLOWED, "params_secret": "5a" * 32,
                "engine_id": f"conformance-{role}", "transport": "tcp", "open_retry_s": 0.5}
