"""start_worker_server: one grpc.aio server with the Worker service, the standard health service
and (given keys) the KV-event publisher, around an AsyncEngine the caller owns.

    server, port = await start_worker_server(engine, "both")            # aggregated, loopback
    server, port = await start_worker_server(engine, PrefillRole(), port=50051, tls=TLSConfig(...),
                                             kv_events=KVEventsConfig.from_key_dir(DIR))
    ...
    await server.stop(grace=5.0)   # NOT_SERVING, abort in-flight requests, close sockets
    engine.shutdown()              # the engine is the caller's
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import grpc

from pdcluster._proto import worker_pb2_grpc
from pdcluster.grpc_decode import add_servicer
from pdcluster.security.grpc_authz import AioRoleInterceptor, RolePolicy
from pdcluster.security.rotation import dynamic_server_credentials
from pdcluster.security.tls_audit import HandshakeAudit
from pdcluster.worker.health import EngineHealth
from pdcluster.worker.options import DEFAULT_MAX_MESSAGE_BYTES, MAX_CONCURRENT_RPCS, server_options
from pdcluster.worker.roles import AggregatedRole, RoleHandler
from pdcluster.worker.tls import TLSConfig, server_credentials
from pdcluster.worker.worker_servicer import WorkerServicer

if TYPE_CHECKING:
    from pdcluster.engine.async_engine import AsyncEngine
    from pdcluster.worker.kv_events import KVEventsConfig, KVEventService

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"  # loopback by default; binding elsewhere is explicit (DESIGN.md 9)


class WorkerServer:
    """A running worker endpoint. `stop()` tears down everything start_worker_server made."""

    def __init__(self, grpc_server: grpc.aio.Server, servicer: WorkerServicer, health: EngineHealth,
                 kv_events: KVEventService | None, address: str) -> None:
        self.grpc_server = grpc_server
        self.servicer = servicer
        self.health = health
        self.kv_events = kv_events
        self.address = address
        self.authz: RolePolicy | None = None
        self.tls_audit: HandshakeAudit | None = None  # refused TLS handshakes (a Prometheus collector)
        self._stopped = False

    @property
    def worker_id(self) -> str:
        return self.servicer.worker_id

    async def drain(self, timeout_s: float | None = None) -> tuple[int, int]:
        """Stop admitting, report NOT_SERVING, let running requests finish until timeout_s (default
        the servicer's drain_timeout_s), end the rest with UNAVAILABLE; then stop() closes."""
        return await self.servicer.drain(timeout_s)

    async def stop(self, grace: float | None = 5.0) -> None:
        if self._stopped:
            return
        self._stopped = True
        await self.health.shutdown()
        # Streams end with finish_reason ABORT (clients see why) and their blocks are freed.
        num = self.servicer.abort_all()
        if num:
            log.info("aborted %d in-flight request(s) at shutdown", num)
        await self.grpc_server.stop(grace)
        if self.tls_audit is not None:
            self.tls_audit.stop()
        if self.kv_events is not None:
            await self.kv_events.close()

    async def wait_for_termination(self, timeout: float | None = None) -> bool:
        return await self.grpc_server.wait_for_termination(timeout)


def _resolve_role(role: RoleHandler | str) -> RoleHandler:
    if isinstance(role, RoleHandler):
        return role
    if role == "both":
        return AggregatedRole()
    if role in ("prefill", "decode", "encode"):
        # The core does not import the role packages (imports point down, DESIGN.md 2); the
        # worker assembly resolves role names through pdcluster.worker.role_registry.
        pkg = f"pdcluster.{role}_worker.{role.capitalize()}Role"
        raise ValueError(f"role {role!r}: pass a role object, e.g. {pkg}()")
    raise ValueError(f"role must be 'prefill', 'decode', 'both', 'encode' or a RoleHandler, got {role!r}")


# Encode too: it makes the worker compute and hold encoder outputs under a lease, on request data;
# ProvideKVParams: it tells a decode leg which producer's blocks to read.
ROUTER_ONLY = ("Generate", "GenerateStream", "Abort", "Drain", "Encode", "ProvideKVParams")


def worker_policy() -> RolePolicy:
    """Which roles may call which Worker methods when the server runs mutual TLS."""
    return RolePolicy({f"/pdcluster.v1.Worker/{name}": {"router"} for name in ROUTER_ONLY})


def _tls_credentials(tls: TLSConfig, audit: HandshakeAudit | None = None) -> grpc.ServerCredentials:
    """Credentials that follow the files (certificate and CA-bundle rotation without restart,
    security/rotation.py); server_credentials first, for its checks and error messages."""
    server_credentials(tls)
    assert tls.cert is not None and tls.key is not None
    return dynamic_server_credentials(tls.cert, tls.key, tls.ca,
                                      on_handshake=audit.on_handshake if audit is not None else None)[0]


def _format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


async def start_worker_server(
    engine: AsyncEngine,
    role: RoleHandler | str,
    host: str = DEFAULT_HOST,
    port: int = 0,
    tls: TLSConfig | None = None,
    *,
    worker_id: str | None = None,
    kv_events: KVEventsConfig | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    epoch: int | None = None,
) -> tuple[WorkerServer, int]:
    """Serve `engine` (an AsyncEngine) on host:port (0 = pick a free port); returns the running
    server and the bound port. kv_events: a KVEventsConfig; None disables the publisher (Stats
    then reports empty KV-event endpoints). The epoch identifies this incarnation of the worker
    (WorkerInfo.engine_epoch and the KV-event epoch); default: start time in ns."""
    handler = _resolve_role(role)
    epoch = time.time_ns() if epoch is None else epoch
    # Under mutual TLS the caller's certificate names its role: only the router starts, aborts or
    # drains requests or asks for encodings (pdcluster/security/grpc_authz.py); health and info
    # need only the handshake.
    policy = worker_policy() if tls is not None and tls.ca is not None else None
    interceptors: list = [AioRoleInterceptor(policy)] if policy is not None else []
    audit = HandshakeAudit("worker") if tls is not None else None  # refused handshakes, named
    if audit is not None:
        interceptors.insert(0, audit.interceptor())
    server = grpc.aio.server(options=server_options(max_message_bytes), maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
                             interceptors=interceptors)
    address = _format_address(host, port)
    try:
        bound = server.add_secure_port(address, _tls_credentials(tls, audit)) if tls is not None \
            else server.add_insecure_port(address)
    except RuntimeError:  # newer grpcio raises where older versions returned 0
        bound = 0
    if bound == 0:
        raise OSError(f"could not bind the worker gRPC server to {address}")
    worker_id = worker_id or f"{handler.name}@{_format_address(host, bound)}"
    publisher = None
    if kv_events is not None:
        from pdcluster.worker.kv_events import KVEventService  # zmq only when publishing

        publisher = KVEventService(engine, kv_events, worker_id, epoch)
    try:
        servicer = WorkerServicer(engine, handler, worker_id=worker_id, epoch=epoch, kv_events=publisher)
        health = EngineHealth(engine)
        servicer.health = health
        add_servicer(worker_pb2_grpc.add_WorkerServicer_to_server, servicer, server)
        from grpc_health.v1 import health_pb2_grpc

        health_pb2_grpc.add_HealthServicer_to_server(health.servicer, server)
        await server.start()
        await health.start()
        if publisher is not None:
            publisher.start()
    except BaseException:
        await server.stop(None)
        if publisher is not None:
            await publisher.close()
        raise
    worker_server = WorkerServer(server, servicer, health, publisher, _format_address(host, bound))
    worker_server.authz = policy  # refusals by method and role (None without mTLS)
    if audit is not None:
        worker_server.tls_audit = audit.start(bound)
    return worker_server, bound
