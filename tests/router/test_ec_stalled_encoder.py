"""An encoder that stalls (its process SIGSTOPped, not killed) costs a multimodal request only
encode_timeout_s: the Encode RPC ends at that bound, the request goes on without encoder outputs,
its aggregated leg encodes locally and the request answers well before its own deadline, and so
does the next one. The encoder is a fake Worker in its own process (ec_stall_encoder_proc.py); the
aggregated worker is an in-process fake that records what it was sent. No model, no timing asserts."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdcluster._proto import common_pb2, worker_pb2, worker_pb2_grpc
from pdcluster.router.config import RouterConfig
from pdcluster.router.metrics import RouterMetrics
from pdcluster.router.orchestrator import Orchestrator
from pdcluster.router.policies import ROUTING_POLICIES
from pdcluster.router.preprocess import PreparedRequest
from pdcluster.router.registry import WorkerRegistry

ENCODER = os.path.join(os.path.dirname(__file__), "ec_stall_encoder_proc.py")
IMAGE = b"\x89PNG an image"


class Aggregated(worker_pb2_grpc.WorkerServicer):
    def __init__(self) -> None:
        self.requests: list[worker_pb2.WorkerGenerateRequest] = []

    async def GetInfo(self, request, context):  # noqa: N802
        return worker_pb2.WorkerInfo(worker_id="both-0", role=common_pb2.WORKER_ROLE_BOTH, model="m", block_size=16,
                                     engine_epoch=1)

    async def Stats(self, request, context):  # noqa: N802
        return common_pb2.WorkerStats(worker_id="both-0", role=common_pb2.WORKER_ROLE_BOTH, block_size=16)

    async def Generate(self, request, context):  # noqa: N802
        self.requests.append(request)
        yield worker_pb2.WorkerGenerateResponse(request_id=request.request_id, finished=True, token_ids=[5, 6, 7],
                                                finish_reason=common_pb2.FINISH_REASON_LENGTH)


def test_a_stalled_encoder_costs_encode_timeout_then_local_encode() -> None:
    proc = subprocess.Popen([sys.executable, ENCODER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        encoder_address = f"127.0.0.1:{int(proc.stdout.readline())}"
        asyncio.run(asyncio.wait_for(_main(proc, encoder_address), 120))
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait(30)


async def _main(proc: subprocess.Popen, encoder_address: str) -> None:
    agg = Aggregated()
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(agg, server)
    h = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(h, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    await h.set("pdcluster.v1.Worker", health_pb2.HealthCheckResponse.SERVING)
    # One probe per worker at start, then none for the test's length: the stopped encoder stays in
    # the rotation, so the Encode RPC itself must be what is bounded.
    config = RouterConfig(workers=(encoder_address, address), policy="round_robin", worker_channel="call",
                          health_interval_s=600.0, encode_timeout_s=1.0, grpc_port=0, http_port=None)
    registry = WorkerRegistry(config)
    await registry.start()
    metrics = RouterMetrics()
    orch = Orchestrator(config, registry, ROUTING_POLICIES.get("round_robin")(), metrics)
    try:
        assert await registry.wait_for_healthy(2, 30.0)
        assert await _generate(orch, "warm", [IMAGE]) == [5, 6, 7]
        assert [p.producer_id for p in agg.requests[0].ec_transfer_params] == ["encode-0"]  # E answered
        os.kill(proc.pid, signal.SIGSTOP)  # stalls: alive, connected, never answers
        for i, image in enumerate((b"\x89PNG second", b"\x89PNG third")):
            assert await _generate(orch, f"stalled-{i}", [image]) == [5, 6, 7]
            assert not agg.requests[-1].ec_transfer_params  # no encoder outputs: encoded locally
            assert list(agg.requests[-1].images) == [image]  # the router kept the media for that
        assert metrics.ec_encodes.labels("deadline_exceeded").value == 2
        assert metrics.ec_encodes.labels("ok").value == 1
    finally:
        await orch.close()
        await registry.stop()
        await server.stop(None)


async def _generate(orch: Orchestrator, request_id: str, images: list[bytes]) -> list[int]:
    prep = PreparedRequest(request_id, [1, 2, 3, 4], common_pb2.SamplingParams(max_tokens=3), max_tokens=3,
                           images=list(images), deadline=time.monotonic() + 60.0)
    state = orch.open_request(prep, "grpc")
    out: list[int] = []
    async for resp in orch.stream(state):
        assert resp.finish_reason != common_pb2.FINISH_REASON_ERROR, resp
        out.extend(resp.token_ids)
    return out
