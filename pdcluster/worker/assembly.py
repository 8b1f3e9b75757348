"""One worker process, assembled: role + engine (with its connector half) + server, until a signal.

    WorkerConfig (plain values; `pdcluster serve-worker` and `python -m pdcluster.<role>_worker`
    fill it from their flags)
        -> resolve_role(config.role)             WorkerRole: handler, connector half, metrics
        -> tls_config / kv_events_config /       checked before the (slow) engine load, so a
           connector_options                     config mistake fails in milliseconds
        -> build_engine()                        AsyncEngine with kv_role = the role's half
        -> start_worker_server()                 WorkerServicer + RequestTable + health + KV events
        -> start_metrics()                       Prometheus on --metrics-host:--metrics-port
        -> on_ready(server, port, metrics_url)   the caller announces it (the READY line)
        SIGTERM / SIGINT -> server.drain(drain_timeout_s): NOT_SERVING, refuse new requests, let
                            running ones finish, end the rest with UNAVAILABLE (routers resume
                            them elsewhere) -> server.stop(): close the sockets

Nothing here parses flags, and nothing is imported until it is needed (the CLI imports this
module to build its parser quickly).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdcluster.worker.role_registry import WorkerRole, resolve_role

if TYPE_CHECKING:
    from pdcluster.engine.async_engine import AsyncEngine
    from pdcluster.worker.kv_events import KVEventsConfig
    from pdcluster.worker.metrics import MetricsServer
    from pdcluster.worker.roles import RoleHandler
    from pdcluster.worker.server import WorkerServer
    from pdcluster.worker.tls import TLSConfig

log = logging.getLogger("pdcluster.worker")


@dataclass(frozen=True)
class WorkerConfig:
    role: str = "both"
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str | None = None
    worker_id: str | None = None
    max_message_bytes: int | None = None
    key_dir: str | None = None
    key_name: str = "worker"
    kv_events_allow: Sequence[str] = ("router",)
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    kv_connector: str | None = None
    kv_connector_options: Mapping[str, Any] = field(default_factory=dict)
    # Encoder-cache (EC) connector ("" = none; None = the role's default, e.g. p2p_ec for encode)
    # and its options (plain data; a deployment's secrets arrive through the environment).
    ec_connector: str | None = None
    ec_connector_options: Mapping[str, Any] = field(default_factory=dict)
    engine: Mapping[str, Any] = field(default_factory=dict)  # EngineArgs keywords (not the connector's)
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = 0  # 0: a free port; None: no metrics endpoint
    drain_timeout_s: float = 10.0  # SIGTERM: how long running requests may finish before they move


def advertise_host(config: WorkerConfig) -> str:
    """The host peers use to reach this worker: a wildcard bind address is not reachable."""
    if config.advertise_host:
        return config.advertise_host
    return socket.gethostname() if config.host in ("0.0.0.0", "::", "") else config.host


def tls_config(config: WorkerConfig) -> TLSConfig | None:
    if not (config.tls_cert or config.tls_key or config.tls_ca):
        return None
    from pdcluster.worker.tls import TLSConfig

    if config.tls_ca and not config.tls_cert:
        raise ValueError("--tls-ca needs --tls-cert and --tls-key")
    return TLSConfig(cert=config.tls_cert, key=config.tls_key, ca=config.tls_ca)


def kv_events_config(config: WorkerConfig) -> KVEventsConfig | None:
    from pdcluster.worker.kv_events import KVEventsConfig

    common = {"bind_host": config.host, "advertise_host": advertise_host(config)}
    if config.key_dir:
        return KVEventsConfig.from_key_dir(config.key_dir, key_name=config.key_name,
                                           allow_names=list(config.kv_events_allow), **common)
    events = KVEventsConfig.from_env(**common)
    if events is None:
        log.warning("no CURVE keys (--key-dir or PDCLUSTER_WORKER_KEY): KV-event publishing is disabled")
    return events


def connector_options(config: WorkerConfig, role: WorkerRole) -> dict[str, Any]:
    """The connector's options; by default a connector takes this worker's CURVE keys from the
    key directory and its id from the worker id."""
    options = dict(config.kv_connector_options)
    if config.kv_connector is None:
        if options:
            raise ValueError("--kv-connector-options given without --kv-connector")
        if role.needs_connector:
            log.warning("--role %s without --kv-connector: this worker serves only local requests "
                        "(remote %s legs are refused)", role.name, role.name)
        return {}
    from pdcluster.connectors.registry import resolve_connector_class

    takes = resolve_connector_class(config.kv_connector).deployment_options
    if config.key_dir and {"keys_dir", "key_name"} <= takes and not ({"keypair", "keys_dir"} & set(options)):
        options.update(keys_dir=config.key_dir, key_name=config.key_name)
    if config.worker_id and "engine_id" in takes and "engine_id" not in options:
        options["engine_id"] = config.worker_id
    if options.get("tls_identity") == "worker" and "tls_identity" in takes:
        # The launcher asks the connector to reach its store with this worker's own mTLS identity
        # (its --tls-cert/--tls-key, and --tls-ca as the store's CA): one identity per process.
        del options["tls_identity"]
        options.update(tls_cert=config.tls_cert, tls_key=config.tls_key, tls_ca=config.tls_ca)
    return options


def ec_connector_name(config: WorkerConfig, role: WorkerRole) -> str:
    """The EC connector this worker runs: the configured one, else the role's default."""
    return role.default_ec_connector if config.ec_connector is None else config.ec_connector


def ec_connector_options(config: WorkerConfig, role: WorkerRole) -> dict[str, Any]:
    """The EC connector's options; by default it binds where the worker binds, on a free port,
    with this worker's CURVE keys from the key directory and the worker id as its producer id
    (as the P2P KV connector gets them)."""
    options = dict(config.ec_connector_options)
    if not ec_connector_name(config, role):
        if options:
            raise ValueError("--ec-connector-options given without an EC connector (--ec-connector)")
        return {}
    options.setdefault("role", role.ec_role)
    options.setdefault("host", config.host)
    options.setdefault("port", 0)
    if config.advertise_host:
        options.setdefault("advertise_host", config.advertise_host)
    if config.key_dir and not ({"keypair", "keys_dir"} & set(options)):
        options.update(keys_dir=config.key_dir, key_name=config.key_name)
    if config.worker_id:
        options.setdefault("engine_id", config.worker_id)
    return options


def build_engine(config: WorkerConfig, role: WorkerRole, options: Mapping[str, Any]) -> AsyncEngine:
    """The engine, with the half of the connector this role wires (none without a connector)."""
    from pdcluster.config import EngineArgs
    from pdcluster.engine.async_engine import AsyncEngine

    factory = None
    if config.kv_connector is not None:
        from pdcluster.connectors import engine_connector_factory as factory
    ec: dict[str, Any] = {}
    ec_factory = None
    ec_name = ec_connector_name(config, role)
    if ec_name:
        from pdcluster.connectors import ec_connector_factory as ec_factory

        ec.update(ec_connector=ec_name, ec_connector_options=ec_connector_options(config, role))
    if role.encoder_only:
        ec["encoder_only"] = True
    args = EngineArgs(**config.engine, kv_connector=config.kv_connector, kv_connector_options=dict(options),
                      kv_role=role.kv_role, **ec)
    if ec_factory is None:  # the EC arguments only when used: nothing changes for text-only workers
        return AsyncEngine.from_engine_args(args, connector=factory)
    return AsyncEngine.from_engine_args(args, connector=factory, ec_connector=ec_factory)


def run_worker(config: WorkerConfig, on_ready: Callable[[WorkerServer, int, str], None]) -> None:
    """Assemble the worker and serve until SIGTERM / SIGINT; the engine is shut down on the way out."""
    role = resolve_role(config.role)
    tls = tls_config(config)
    kv_events = kv_events_config(config)
    options = connector_options(config, role)
    ec_connector_options(config, role)  # a mistake there fails before the engine loads
    handler = role.make_handler(config.kv_connector)
    engine = build_engine(config, role, options)
    try:
        asyncio.run(_serve(config, role, engine, handler, tls, kv_events, on_ready))
    finally:
        engine.shutdown()


async def _serve(config: WorkerConfig, role: WorkerRole, engine: AsyncEngine, handler: RoleHandler,
                 tls: TLSConfig | None, kv_events: KVEventsConfig | None,
                 on_ready: Callable[[WorkerServer, int, str], None]) -> None:
    from pdcluster.worker.options import DEFAULT_MAX_MESSAGE_BYTES
    from pdcluster.worker.server import start_worker_server

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server, port = await start_worker_server(
        engine, handler, config.host, config.port, tls, worker_id=config.worker_id, kv_events=kv_events,
        max_message_bytes=config.max_message_bytes or DEFAULT_MAX_MESSAGE_BYTES)
    server.servicer.drain_timeout_s = config.drain_timeout_s
    metrics = start_metrics(config, role, engine, server)
    on_ready(server, port, metrics.url if metrics is not None else "")
    log.info("worker %s (%s) serving on %s", server.worker_id, role.name, server.address)
    await stop.wait()
    await server.drain(config.drain_timeout_s)
    log.info("shutting down; %s stats: %s", role.name, role.role_metrics(engine.get_stats()))
    await server.stop(grace=2.0)
    if metrics is not None:
        metrics.stop()


def start_metrics(config: WorkerConfig, role: WorkerRole, engine: AsyncEngine,
                  server: WorkerServer) -> MetricsServer | None:
    """The worker's Prometheus endpoint (pdcluster.worker.metrics), or None with metrics_port None."""
    if config.metrics_port is None:
        return None
    from pdcluster.worker.metrics import start_metrics_server
    from pdcluster.worker.metrics_collector import WorkerCollector

    refusals = getattr(server.kv_events, "refusals", None)
    collector = WorkerCollector(engine, role, worker_id=server.worker_id, connector=config.kv_connector,
                                requests=getattr(server.servicer, "requests", None),
                                handshake_registry=getattr(refusals, "registry", None))
    audit = [server.tls_audit] if getattr(server, "tls_audit", None) is not None else []  # refused TLS handshakes
    return start_metrics_server(collector, *audit, host=config.metrics_host, port=config.metrics_port,
                                advertise_host=config.advertise_host)
