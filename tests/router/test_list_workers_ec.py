"""ListWorkers shows each worker's EC producer endpoint from its WorkerInfo (fake in-process gRPC
workers on 127.0.0.1, a real WorkerRegistry and RouterServicer; no model)."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdcluster._proto import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc
from pdcluster.router.config import RouterConfig
from pdcluster.router.metrics import RouterMetrics
from pdcluster.router.orchestrator import Orchestrator
from pdcluster.router.policies import ROUTING_POLICIES
from pdcluster.router.registry import WorkerRegistry
from pdcluster.router.server import RouterServicer

KEY = b"Yne@$w-vo<fVvi]a<NY6T1ed:M$fCG*[IaLV{hID"  # 40 Z85 characters


class InfoWorker(worker_pb2_grpc.WorkerServicer):
    def __init__(self, name: str, role: int, ec_endpoint: str = "") -> None:
        self.name, self.role, self.ec_endpoint = name, role, ec_endpoint

    async def GetInfo(self, request, context):  # noqa: N802
        info = worker_pb2.WorkerInfo(worker_id=self.name, role=self.role, model="m", block_size=16, engine_epoch=1)
        if self.ec_endpoint:
            info.ec_connector, info.ec_endpoint, info.ec_public_key = "p2p_ec", self.ec_endpoint, KEY
        return info

    async def Stats(self, request, context):  # noqa: N802
        return common_pb2.WorkerStats(worker_id=self.name, role=self.role, block_size=16)


def test_list_workers_shows_the_ec_endpoint() -> None:
    async def main() -> None:
        workers = [InfoWorker("encode-0", common_pb2.WORKER_ROLE_ENCODE, "127.0.0.1:7123"),
                   InfoWorker("decode-0", common_pb2.WORKER_ROLE_DECODE)]
        servers, addresses = [], []
        for w in workers:
            server = grpc.aio.server()
            worker_pb2_grpc.add_WorkerServicer_to_server(w, server)
            h = health.aio.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(h, server)
            addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
            await server.start()
            await h.set("pdcluster.v1.Worker", health_pb2.HealthCheckResponse.SERVING)
            servers.append(server)
        config = RouterConfig(workers=tuple(addresses), policy="round_robin", worker_channel="call",
                              health_interval_s=0.05, grpc_port=0, http_port=None)
        registry = WorkerRegistry(config)
        await registry.start()
        orch = Orchestrator(config, registry, ROUTING_POLICIES.get("round_robin")(), RouterMetrics())
        try:
            assert await registry.wait_for_healthy(2, 10.0)
            servicer = RouterServicer(config, None, orch, registry)  # type: ignore[arg-type]
            resp = await servicer.ListWorkers(router_pb2.ListWorkersRequest(), None)  # type: ignore[arg-type]
            by_id = {e.worker_id: e for e in resp.workers}
            assert by_id["encode-0"].ec_endpoint == "127.0.0.1:7123" and by_id["encode-0"].ec_public_key == KEY
            assert by_id["decode-0"].ec_endpoint == "" and by_id["decode-0"].ec_public_key == b""
        finally:
            await orch.close()
            await registry.stop()
            for s in servers:
                await s.stop(None)

    asyncio.run(asyncio.wait_for(main(), 30))
