"""The router's gRPC frontend: the Router service (Generate, Abort, ListWorkers) and the standard
health service, on one grpc.aio server.

Deadlines: the client's deadline (context.time_remaining) becomes the request's deadline and is
forwarded to every worker leg; requests without one get request_timeout_s so nothing waits
forever. Cancellation: grpc.aio cancels this handler when the client cancels or its deadline
passes; the CancelledError reaches the orchestrator, which aborts the request on its workers.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from pdcluster._proto import common_pb2, router_pb2, router_pb2_grpc
from pdcluster.grpc_decode import add_servicer
from pdcluster.grpc_limits import common_server_options
from pdcluster.security.rotation import dynamic_server_credentials
from pdcluster.security.tls_audit import HandshakeAudit
from pdcluster.worker.tls import server_credentials

from .admission import Admission
from .auth import ApiKey
from .config import RouterConfig
from .convert import response_from_worker
from .errors import RouterError
from .orchestrator import Orchestrator
from .preprocess import Preprocessor
from .registry import WorkerRegistry

ROUTER_HEALTH_SERVICE = "pdcluster.v1.Router"
_ROLES = {"prefill": common_pb2.WORKER_ROLE_PREFILL, "decode": common_pb2.WORKER_ROLE_DECODE,
          "both": common_pb2.WORKER_ROLE_BOTH, "encode": common_pb2.WORKER_ROLE_ENCODE}


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, config: RouterConfig, preprocessor: Preprocessor, orchestrator: Orchestrator,
                 registry: WorkerRegistry, admission: Admission | None = None) -> None:
        self.config = config
        self.pre = preprocessor
        self.orch = orchestrator
        self.registry = registry
        self.admission = admission or Admission(config.max_inflight, orchestrator, orchestrator.metrics)

    async def Generate(self, request: router_pb2.GenerateRequest,  # noqa: N802 - gRPC method name
                       context: grpc.aio.ServicerContext) -> None:
        # A coroutine that writes, not an async generator that yields: grpc.aio would drive a
        # generator with `async for ... await context.write()` anyway, so this is the same wire
        # behaviour with one async-generator layer less per request and per delta. A client
        # cancel arrives as CancelledError at an await here; aclosing then closes the
        # orchestrator's stream at once (it aborts the worker legs).
        timeout = context.time_remaining()
        try:
            with self.admission.preparing("grpc"):  # refused before tokenizing when full
                prep = await self.pre.prepare(request, timeout if timeout is not None else self.config.request_timeout_s)
        except RouterError as e:
            self.orch.count_refused("grpc", e)
            await context.abort(e.code, e.message)
        try:
            state = self.orch.open_request(prep, "grpc")
        except RouterError as e:
            await context.abort(e.code, e.message)
        first = True
        request_id = prep.request_id
        try:
            async with aclosing(self.orch.stream(state)) as deltas:
                async for delta in deltas:
                    out = response_from_worker(delta, request_id)
                    if first and prep.return_prompt_token_ids:
                        out.prompt_token_ids.extend(prep.prompt_token_ids)
                    first = False
                    if delta.finished:
                        out.route.CopyFrom(state.route)
                        out.first_token_time = state.first_token_time
                        if not out.HasField("usage"):
                            out.usage.prompt_tokens = len(prep.prompt_token_ids)
                            out.usage.completion_tokens = state.num_generated
                    await context.write(out)
        except RouterError as e:  # only before the first delta (the orchestrator's contract)
            await context.abort(e.code, e.message)

    async def Abort(self, request: common_pb2.AbortRequest,  # noqa: N802
                    context: grpc.aio.ServicerContext) -> common_pb2.AbortResponse:
        ids = list(request.request_ids)
        if len(ids) > self.config.max_inflight * 2:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_ids: too many ids in one call")
        return common_pb2.AbortResponse(aborted_request_ids=await self.orch.abort(ids))

    async def ListWorkers(self, request: router_pb2.ListWorkersRequest,  # noqa: N802
                          context: grpc.aio.ServicerContext) -> router_pb2.ListWorkersResponse:
        out = router_pb2.ListWorkersResponse()
        now = time.monotonic()
        for h in self.registry.handles:
            role = _ROLES.get(h.role, common_pb2.WORKER_ROLE_UNSPECIFIED)
            if request.role and role != request.role:
                continue
            entry = out.workers.add(worker_id=h.worker_id, address=h.address, role=role, healthy=h.healthy,
                                    num_inflight=h.num_inflight)
            if h.stats is not None:
                entry.stats.CopyFrom(h.stats)
                entry.stats_age_s = max(0.0, now - h.stats_at)
            if h.info is not None and h.info.ec_endpoint:
                entry.ec_endpoint, entry.ec_public_key = h.info.ec_endpoint, h.info.ec_public_key
        return out


class RouterHealth:
    """The standard health service, SERVING while at least one worker takes traffic."""

    def __init__(self, registry: WorkerRegistry) -> None:
        self.servicer = health_aio.HealthServicer()
        self._registry = registry
        self._serving: bool | None = None
        self._tasks: set[asyncio.Task] = set()

    def update(self) -> None:
        serving = self._registry.num_healthy > 0
        if serving == self._serving:
            return
        self._serving = serving
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        task = asyncio.get_running_loop().create_task(self._set(status))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _set(self, status: int) -> None:
        await self.servicer.set("", status)
        await self.servicer.set(ROUTER_HEALTH_SERVICE, status)


def build_grpc_server(config: RouterConfig, servicer: RouterServicer, health: RouterHealth,
                      audit: HandshakeAudit | None = None) -> tuple[grpc.aio.Server, int]:
    """A server with the Router and health services bound to host:grpc_port; returns it and the
    bound port (grpc_port 0 picks a free one). audit: with TLS, counts refused handshakes."""
    interceptors: list = [ApiKey(config.api_key).grpc_interceptor()] if config.api_key is not None else []
    if audit is not None:
        interceptors.insert(0, audit.interceptor())
    server = grpc.aio.server(interceptors=interceptors, maximum_concurrent_rpcs=config.concurrent_rpcs, options=[
        ("grpc.max_receive_message_length", config.max_message_bytes),  # larger -> RESOURCE_EXHAUSTED
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_concurrent_streams", config.streams_per_connection),  # per connection (one peer's channel)
        # gRPC sets SO_REUSEPORT by default: a second server could then share a busy port
        # silently. A port in use must be an error.
        ("grpc.so_reuseport", 0),
        *common_server_options(),
    ])
    add_servicer(router_pb2_grpc.add_RouterServicer_to_server, servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health.servicer, server)
    address = f"[{config.host}]:{config.grpc_port}" if ":" in config.host else f"{config.host}:{config.grpc_port}"
    try:
        if config.tls is not None:
            # server_credentials for its checks and messages; then credentials that follow the
            # files (a reissued certificate or CA bundle is served without a restart).
            server_credentials(config.tls)
            port = server.add_secure_port(address, dynamic_server_credentials(
                str(config.tls.cert), str(config.tls.key), config.tls.ca,
                on_handshake=audit.on_handshake if audit is not None else None)[0])
        else:
            port = server.add_insecure_port(address)
    except RuntimeError:  # newer grpcio raises where older ones returned 0
        port = 0
    if port == 0:
        raise OSError(f"cannot bind the router's gRPC port {address} (in use, or not an address of this machine)")
    return server, port
