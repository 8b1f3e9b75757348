"""The pdcluster gRPC backend against a stand-in for pdcluster.client.AsyncClient."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from pdcluster.cluster.bench.backend import BackendConfig
from pdcluster.cluster.bench.pdcluster_backend import PdclusterBackend
from pdcluster.cluster.bench.request import BenchRequest


@dataclass
class Delta:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None


class FakeRpcError(Exception):
    def code(self) -> str:
        return "StatusCode.RESOURCE_EXHAUSTED"

    def details(self) -> str:
        return "router is full"


class FakeClient:
    """Streams two tokens in the first delta, then one per delta, then a bare finish delta."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.calls: list[tuple] = []
        self.entered = self.exited = False

    async def __aenter__(self) -> FakeClient:
        self.entered = True
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.exited = True

    async def generate_stream(self, prompt, params, request_id: str = "") -> AsyncIterator[Delta]:
        self.calls.append((prompt, params, request_id))
        if prompt == "reject":
            raise FakeRpcError("raw multi-line dump")
        await asyncio.sleep(0.03)
        yield Delta([7, 8], " a b")
        for i in range(params.max_tokens - 2):
            await asyncio.sleep(0.01)
            yield Delta([9 + i], f" t{i}")
        yield Delta([], "", finish_reason="length")


def _run(backend: PdclusterBackend, *reqs: BenchRequest):
    async def go():
        async with backend:
            return await asyncio.gather(*(backend.request(r) for r in reqs))

    return asyncio.run(go())


def test_stream_timings_and_token_counts() -> None:
    clients: list[FakeClient] = []

    def factory(address: str) -> FakeClient:
        clients.append(FakeClient(address))
        return clients[-1]

    backend = PdclusterBackend(BackendConfig("pdcluster", "127.0.0.1:50051", ignore_eos=True), factory)
    ok, ids = _run(backend, BenchRequest("hello", 1, 4, request_id="bench-x-0"), BenchRequest([1, 2, 3], 3, 3))
    [client] = clients
    assert client.address == "127.0.0.1:50051" and client.entered and client.exited
    assert ok.success and ok.output_len == 4 and ok.generated_text == " a b t0 t1"
    assert len(ok.itl) == 2  # two deltas after the first; the bare finish delta is not a chunk
    assert ok.ttft >= 0.025 and ok.latency == pytest.approx(ok.ttft + sum(ok.itl))
    prompt, params, request_id = client.calls[0]
    assert (prompt, request_id) == ("hello", "bench-x-0")
    assert params.max_tokens == 4 and params.ignore_eos and params.temperature == 0.0
    assert client.calls[1][0] == [1, 2, 3] and ids.success and ids.output_len == 3


def test_rpc_errors_are_recorded_compactly() -> None:
    backend = PdclusterBackend(BackendConfig("pdcluster", "h:1"), FakeClient)
    [r] = _run(backend, BenchRequest("reject", 1, 2))
    assert not r.success
    assert r.error == "FakeRpcError: StatusCode.RESOURCE_EXHAUSTED: router is full"


def test_clients_with_a_plain_close() -> None:
    closed = []

    class Plain:
        def __init__(self, address: str) -> None:
            pass

        async def close(self) -> None:
            closed.append(True)

        async def generate_stream(self, prompt, params, request_id: str = ""):
            yield Delta([1], "x")

    [r] = _run(PdclusterBackend(BackendConfig("pdcluster", "h:1"), Plain), BenchRequest("p", 1, 1))
    assert r.success and r.ttft > 0 and r.itl == [] and closed == [True]
