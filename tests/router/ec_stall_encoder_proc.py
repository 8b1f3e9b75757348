"""A fake encode worker in its own process (the test SIGSTOPs it): the Worker API's GetInfo, Stats
and Encode (one leased item per image) plus grpc.health, on 127.0.0.1. Prints its port, then
serves until stdin closes."""

from __future__ import annotations

import asyncio
import hashlib
import sys
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdcluster._proto import common_pb2, worker_pb2, worker_pb2_grpc


class Encoder(worker_pb2_grpc.WorkerServicer):
    async def GetInfo(self, request, context):  # noqa: N802
        return worker_pb2.WorkerInfo(worker_id="encode-0", role=common_pb2.WORKER_ROLE_ENCODE, model="m",
                                     block_size=16, engine_epoch=1)

    async def Stats(self, request, context):  # noqa: N802
        return common_pb2.WorkerStats(worker_id="encode-0", role=common_pb2.WORKER_ROLE_ENCODE, block_size=16)

    async def Encode(self, request, context):  # noqa: N802
        p = common_pb2.EcTransferParams(connector="p2p_ec", producer_id="encode-0", address="127.0.0.1:1",
                                        expires_at=time.time() + 60)
        for image in dict.fromkeys(request.images):
            p.items.add(mm_hash=hashlib.sha256(image).hexdigest(), lease_id="l", nbytes=64, num_tokens=4)
        return worker_pb2.EncodeResponse(ec_transfer_params=p)


async def main() -> None:
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(Encoder(), server)
    h = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(h, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await h.set("pdcluster.v1.Worker", health_pb2.HealthCheckResponse.SERVING)
    print(port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes stdin
    await server.stop(None)


if __name__ == "__main__":
    asyncio.run(main())
