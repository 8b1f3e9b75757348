"""The router's E -> P -> D flow and encoder-output sharing (router/ec_stage.py) against fake workers:
in-process gRPC servers that speak the Worker API and count, like an engine with an EC connector,
which images they computed, served from their own cache or took from another instance's params.
No model, no torch: the flow's rules in about a second.

    1E+1P+1D   four requests with one image: encoded once in the cluster; P gets the params (D the
               KV, so none: it would fetch outputs it never uses)
    text-only  no Encode call, no params
    2P+1D      no encoder: the second prefill worker gets the first one's params
    encoder killed / failing: the request still answers (P encodes), the next one too
    1E+1 both  aggregated legs get the encoder's params
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import Counter
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdcluster._proto import common_pb2, worker_pb2, worker_pb2_grpc
from pdcluster.router.config import RouterConfig
from pdcluster.router.metrics import RouterMetrics
from pdcluster.router.orchestrator import Orchestrator
from pdcluster.router.policies import ROUTING_POLICIES
from pdcluster.router.preprocess import PreparedRequest
from pdcluster.router.registry import WorkerRegistry

ROLES = {"encode": common_pb2.WORKER_ROLE_ENCODE, "prefill": common_pb2.WORKER_ROLE_PREFILL,
         "decode": common_pb2.WORKER_ROLE_DECODE, "both": common_pb2.WORKER_ROLE_BOTH}


def _hash(image: bytes) -> str:
    return hashlib.sha256(b"fp|" + image).hexdigest()


class FakeWorker(worker_pb2_grpc.WorkerServicer):
    """A worker whose 'engine' encodes images by counting: computed (the tower ran), local_cache
    (its own cache had it), remote (an attached EcTransferParams named it)."""

    def __init__(self, name: str, role: str) -> None:
        self.name, self.role = name, role
        self.mm = Counter()
        self.cache: set[str] = set()
        self.requests: list[worker_pb2.WorkerGenerateRequest] = []
        self.encodes = 0
        self.fail_encode: grpc.StatusCode | None = None
        self.bad_params = False  # Encode answers params a consumer would refuse
        self.server: grpc.aio.Server | None = None
        self.address = ""

    def _encode_images(self, images, params) -> list[str]:
        """The mm hashes this instance computed (and now holds for others)."""
        remote = {i.mm_hash for p in params for i in p.items}
        computed = []
        for mm_hash in dict.fromkeys(_hash(image) for image in images):
            if mm_hash in self.cache:
                self.mm["local_cache"] += 1
            elif mm_hash in remote:
                self.mm["remote"] += 1
                self.cache.add(mm_hash)
            else:
                self.mm["computed"] += 1
                self.cache.add(mm_hash)
                computed.append(mm_hash)
        return computed

    def _params(self, hashes) -> common_pb2.EcTransferParams:
        p = common_pb2.EcTransferParams(connector="p2p_ec", producer_id=self.name, address="127.0.0.1:1",
                                        expires_at=time.time() + 60)
        for h in hashes:
            p.items.add(mm_hash=h, lease_id=f"{self.name}-{h[:8]}", nbytes=64, num_tokens=4)
        return p

    async def GetInfo(self, request, context):  # noqa: N802
        return worker_pb2.WorkerInfo(worker_id=self.name, role=ROLES[self.role], model="m", block_size=16,
                                     engine_epoch=1)

    async def Stats(self, request, context):  # noqa: N802
        return common_pb2.WorkerStats(worker_id=self.name, role=ROLES[self.role], block_size=16)

    async def Abort(self, request, context):  # noqa: N802
        return common_pb2.AbortResponse()

    async def Encode(self, request, context):  # noqa: N802
        self.encodes += 1
        if self.fail_encode is not None:
            await context.abort(self.fail_encode, "encoder failed (test)")
        hashes = [_hash(i) for i in request.images]
        self._encode_images(request.images, [])
        params = self._params(dict.fromkeys(hashes))
        if self.bad_params:
            params.items[0].mm_hash = "not-a-sha256"
        return worker_pb2.EncodeResponse(ec_transfer_params=params)

    async def Generate(self, request, context) -> AsyncIterator[worker_pb2.WorkerGenerateResponse]:  # noqa: N802
        if self.role == "encode":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "encode worker")
        self.requests.append(request)
        kv = request.kv_transfer_params if request.HasField("kv_transfer_params") else None
        decode_leg = kv is not None and kv.do_remote_prefill
        resp = worker_pb2.WorkerGenerateResponse(request_id=request.request_id, finished=True,
                                                 finish_reason=common_pb2.FINISH_REASON_LENGTH)
        if not decode_leg:  # the prompt (with its images) is computed here
            computed = self._encode_images(request.images, request.ec_transfer_params)
            if computed:
                resp.ec_transfer_params.CopyFrom(self._params(computed))
        if kv is not None and kv.do_remote_decode:
            resp.token_ids.append(5)
            resp.kv_transfer_params.CopyFrom(common_pb2.KvTransferParams(producer_id=self.name, num_tokens=4))
        elif decode_leg:
            resp.token_ids.extend([6, 7])
        else:
            resp.token_ids.extend([5, 6, 7])
        yield resp


class Cluster:
    def __init__(self, roles: list[str]) -> None:
        self.workers = [FakeWorker(f"{role}-{i}", role) for i, role in enumerate(roles)]

    async def __aenter__(self) -> Cluster:
        for w in self.workers:
            w.server = grpc.aio.server()
            worker_pb2_grpc.add_WorkerServicer_to_server(w, w.server)
            h = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(h, w.server)
            port = w.server.add_insecure_port("127.0.0.1:0")
            w.address = f"127.0.0.1:{port}"
            await w.server.start()
            r = h.set("pdcluster.v1.Worker", health_pb2.HealthCheckResponse.SERVING)
            if asyncio.iscoroutine(r):
                await r
        self.config = RouterConfig(workers=tuple(w.address for w in self.workers), policy="round_robin",
                                   worker_channel="call", health_interval_s=0.05, grpc_port=0, http_port=None)
        self.registry = WorkerRegistry(self.config)
        await self.registry.start()
        assert await self.registry.wait_for_healthy(len(self.workers), 10.0)
        self.metrics = RouterMetrics()
        self.orch = Orchestrator(self.config, self.registry, ROUTING_POLICIES.get("round_robin")(), self.metrics)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.orch.close()
        await self.registry.stop()
        for w in self.workers:
            if w.server is not None:
                await w.server.stop(None)

    def by_role(self, role: str) -> list[FakeWorker]:
        return [w for w in self.workers if w.role == role]

    def computed(self) -> int:
        return sum(w.mm["computed"] for w in self.workers)

    async def generate(self, request_id: str, images: list[bytes]) -> list[int]:
        prep = PreparedRequest(request_id, [1, 2, 3, 4], common_pb2.SamplingParams(max_tokens=3), max_tokens=3,
                               images=list(images))
        state = self.orch.open_request(prep, "grpc")
        out = []
        async for resp in self.orch.stream(state):
            assert not resp.HasField("ec_transfer_params")  # never forwarded to the client
            out.extend(resp.token_ids)
        return out


IMAGE = b"\x89PNG one image"


def _run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 30))


def test_epd_encodes_an_image_once_in_the_cluster_and_skips_e_for_text() -> None:
    async def main() -> None:
        async with Cluster(["encode", "prefill", "decode"]) as c:
            (enc,), (pre,), (dec,) = c.by_role("encode"), c.by_role("prefill"), c.by_role("decode")
            for i in range(4):
                assert await c.generate(f"r{i}", [IMAGE]) == [5, 6, 7]
            assert c.computed() == 1 and enc.mm == {"computed": 1, "local_cache": 3}
            assert pre.mm == {"remote": 1, "local_cache": 3}  # fetched once, then its own cache
            assert enc.encodes == 4
            for req in pre.requests:  # the prefill leg carries the encoder's params and the image
                assert [p.producer_id for p in req.ec_transfer_params][:1] == ["encode-0"]
                assert list(req.images) == [IMAGE]
            for req in dec.requests:  # the decode leg gets the KV: the image (block hashes), no params
                assert not req.ec_transfer_params and list(req.images) == [IMAGE]
            await c.generate("text", [])
            assert enc.encodes == 4 and not pre.requests[-1].ec_transfer_params  # text-only: no E
    _run(main())


def test_two_prefill_workers_share_an_encoding_without_an_encoder() -> None:
    async def main() -> None:
        async with Cluster(["prefill", "prefill", "decode"]) as c:
            p0, p1 = c.by_role("prefill")
            await c.generate("a", [IMAGE])
            await c.generate("b", [IMAGE])  # round robin: the other prefill worker
            assert len(p0.requests) == 1 and len(p1.requests) == 1
            assert c.computed() == 1
            first, second = sorted((p0, p1), key=lambda w: w.requests[0].request_id)
            assert not first.requests[0].ec_transfer_params
            assert [p.producer_id for p in second.requests[0].ec_transfer_params] == [first.name]
            assert second.mm == {"remote": 1}
            assert c.metrics.ec_attached.labels("shared").value == 1
    _run(main())


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL,
                                  grpc.StatusCode.INVALID_ARGUMENT])
def test_a_failing_encoder_does_not_fail_the_request(code: grpc.StatusCode) -> None:
    async def main() -> None:
        async with Cluster(["encode", "prefill", "decode"]) as c:
            (enc,), (pre,) = c.by_role("encode"), c.by_role("prefill")
            enc.fail_encode = code
            assert await c.generate("r0", [IMAGE]) == [5, 6, 7]
            assert not pre.requests[0].ec_transfer_params and pre.mm["computed"] == 1  # encoded locally
            assert c.metrics.ec_encodes.labels(code.name.lower()).value == 1
            assert await c.generate("r1", [b"another image"]) == [5, 6, 7]  # the next one works too
    _run(main())


def test_malformed_encoder_params_are_dropped_not_forwarded() -> None:
    async def main() -> None:
        async with Cluster(["encode", "prefill", "decode"]) as c:
            (enc,), (pre,) = c.by_role("encode"), c.by_role("prefill")
            enc.bad_params = True
            assert await c.generate("r0", [IMAGE]) == [5, 6, 7]
            assert not pre.requests[0].ec_transfer_params  # the worker would refuse the whole request
            assert c.metrics.ec_encodes.labels("invalid").value == 1
    _run(main())


def test_a_killed_encoder_does_not_fail_the_request() -> None:
    async def main() -> None:
        async with Cluster(["encode", "prefill", "decode"]) as c:
            (enc,), (pre,) = c.by_role("encode"), c.by_role("prefill")
            assert await c.generate("r0", [IMAGE]) == [5, 6, 7]
            await enc.server.stop(None)  # the encoder process is gone
            assert await c.generate("r1", [b"new image"]) == [5, 6, 7]
            assert not pre.requests[1].ec_transfer_params  # nothing live to fetch from: local encode
            assert pre.mm["computed"] == 1
            assert await c.generate("r2", [b"third image"]) == [5, 6, 7]
    _run(main())


def test_aggregated_legs_get_the_encoders_params() -> None:
    async def main() -> None:
        async with Cluster(["encode", "both"]) as c:
            (agg,) = c.by_role("both")
            assert await c.generate("r0", [IMAGE, b"second"]) == [5, 6, 7]
            assert [p.producer_id for p in agg.requests[0].ec_transfer_params] == ["encode-0"]
            assert agg.mm == {"remote": 2} and c.computed() == 2
    _run(main())
