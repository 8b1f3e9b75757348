"""The conformance kit on the built-in P2P connector (in-process producer and consumers, real
CURVE side channel and TCP data plane on 127.0.0.1)."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch
from tiny_models import make_tiny_checkpoint

from pdcluster.connectors.testing import ConformanceEnv, ConnectorConformance
from pdcluster.models import cpu_decode_step
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


class TestP2PConformanceBf16(TestP2PConformance):
    """The same kit on a bfloat16 tiny Llama: on a CPU that computes it in float32 the decode legs
    run the one-call decode step (models/cpu_decode_step.py) with the connector's per-layer hooks
    around it, and must still equal the reference engine token for token."""

    @pytest.fixture(scope="class")
    def env(self, tmp_path_factory: pytest.TempPathFactory) -> Any:
        type(self).model = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("bf16") / "llama",
                                                dtype=torch.bfloat16)
        environment = ConformanceEnv(self, tmp_path_factory.mktemp("conformance"))
        yield environment
        environment.close()

    def test_zz_decode_legs_took_the_one_call_step(self, env: Any) -> None:
        """Runs after the kit's checks (name order): where the driver applies (float32 compute of
        the bf16 weights, a C compiler), the consumers' decode steps went through it."""
        for consumer in env.consumers.values():
            decoder = consumer.core.runner.model.model
            if cpu_decode_step.why_not(decoder) is not None:
                pytest.skip(f"the one-call step does not apply here: {cpu_decode_step.why_not(decoder)}")
            assert decoder.decode_step.steps > 0
