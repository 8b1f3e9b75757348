"""`pdcluster serve-worker`: run one engine behind the Worker gRPC service.

    pdcluster serve-worker --role prefill|decode|both [--model PATH] [--host 127.0.0.1] [--port 0]
        [--worker-id ID] [--key-dir DIR] [--tls-cert F --tls-key F [--tls-ca F]] [--tp T] [engine flags]

Once serving it prints exactly one line to stdout, for launchers to wait on:

    PDCLUSTER_READY {"worker_id": ..., "role": ..., "address": "HOST:PORT", "bind": "HOST:PORT",
                     "port": ..., "pid": ..., "kv_events_endpoint": ..., "kv_snapshot_endpoint": ...,
                     "kv_events_public_key": ..., "epoch": ..., "tls": ...}

(one line of JSON). `address` is what peers dial (--advertise-host, else --host), `bind` what the
server bound; worker_id defaults to ROLE@BIND; the KV-event fields are "" when no keys were
given. Logs go to stderr.
SIGTERM / SIGINT: health NOT_SERVING, abort every request, close the sockets, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys
from typing import Any

READY_PREFIX = "PDCLUSTER_READY"
log = logging.getLogger("pdcluster.worker")


def add_serve_worker(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve-worker", help="serve one engine over gRPC as a prefill, decode or aggregated worker")
    p.add_argument("--role", choices=("prefill", "decode", "both"), default="both")
    p.add_argument("--model", default=None, help="local HF model directory (default: the built-in demo model)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback; others are explicit)")
    p.add_argument("--port", type=int, default=0, help="gRPC port; 0 picks a free one (printed when ready)")
    p.add_argument("--advertise-host", default=None,
                   help="host peers use to reach this worker (default: --host, or the hostname for 0.0.0.0)")
    p.add_argument("--worker-id", default=None)
    p.add_argument("--max-message-bytes", type=int, default=None)
    g = p.add_argument_group("security")
    g.add_argument("--key-dir", default=None, help="keys made by `pdcluster keys init DIR` (enables KV events); "
                   "or set PDCLUSTER_WORKER_KEY and PDCLUSTER_KV_EVENTS_ALLOWED")
    g.add_argument("--key-name", default="worker", help="this worker's key pair in --key-dir")
    g.add_argument("--kv-events-allow", default="router", help="comma-separated key names allowed to subscribe")
    g.add_argument("--tls-cert", default=None)
    g.add_argument("--tls-key", default=None)
    g.add_argument("--tls-ca", default=None, help="CA of client certificates: turns on mutual TLS")
    e = p.add_argument_group("engine")
    e.add_argument("--dtype", default="auto")
    e.add_argument("--device", default="auto")
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--max-num-seqs", type=int, default=64)
    e.add_argument("--max-num-batched-tokens", type=int, default=None)
    e.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    e.add_argument("--num-kv-blocks", type=int, default=None)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1,
                   help="tensor-parallel ranks (one process each; rank 0 serves, the others are its children)")
    e.add_argument("--no-prefix-caching", action="store_true")
    c = p.add_argument_group("kv connector (disaggregated roles)")
    c.add_argument("--kv-connector", default=None,
                   help="p2p | store | an entry-point name | pkg.module:Class (prefill/decode roles need one)")
    c.add_argument("--kv-connector-options", default=None,
                   help="JSON object of connector options, merged over $PDCLUSTER_KV_CONNECTOR_OPTIONS "
                        "(put secrets in the environment: command lines are world-readable)")
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=run_serve_worker)


def run_serve_worker(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Checked before the (slow) engine load so a config mistake fails in milliseconds.
    tls = _tls_config(args)
    kv_events = _kv_events_config(args)
    kv_connector, kv_options = _kv_connector_config(args)
    role = make_role(args.role, kv_connector)
    from pdcluster.config import EngineArgs
    from pdcluster.engine.async_engine import AsyncEngine

    engine = AsyncEngine.from_engine_args(EngineArgs(
        model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        num_kv_blocks=args.num_kv_blocks, seed=args.seed, enable_prefix_caching=not args.no_prefix_caching,
        tensor_parallel_size=args.tp, kv_connector=kv_connector, kv_connector_options=kv_options,
        kv_role=KV_ROLES[args.role]), connector=_connector_factory(kv_connector))
    try:
        asyncio.run(_serve(args, engine, role, tls, kv_events))
    finally:
        engine.shutdown()
    return 0


KV_ROLES = {"prefill": "producer", "decode": "consumer", "both": "both"}
ENV_KV_OPTIONS = "PDCLUSTER_KV_CONNECTOR_OPTIONS"


def _kv_connector_config(args: argparse.Namespace) -> tuple[str | None, dict[str, Any]]:
    """Connector name and options; by default a connector takes this worker's CURVE keys from
    --key-dir and its id from --worker-id."""
    options: dict[str, Any] = {}
    for source, text in (("$" + ENV_KV_OPTIONS, os.environ.get(ENV_KV_OPTIONS)),
                         ("--kv-connector-options", args.kv_connector_options)):
        if text:
            try:
                value = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{source}: not valid JSON ({e.msg})") from None
            if not isinstance(value, dict):
                raise ValueError(f"{source}: must be a JSON object")
            options.update(value)
    if args.kv_connector is None:
        if options:
            raise ValueError("--kv-connector-options given without --kv-connector")
        if args.role != "both":
            log.warning("--role %s without --kv-connector: this worker serves only local requests "
                        "(remote %s legs are refused)", args.role, args.role)
        return None, {}
    from pdcluster.connectors.registry import resolve_connector_class

    takes = resolve_connector_class(args.kv_connector).deployment_options
    if args.key_dir and {"keys_dir", "key_name"} <= takes and not ({"keypair", "keys_dir"} & set(options)):
        options.update(keys_dir=args.key_dir, key_name=args.key_name)
    if args.worker_id and "engine_id" in takes and "engine_id" not in options:
        options["engine_id"] = args.worker_id
    return args.kv_connector, options


def _connector_factory(name: str | None) -> Any:
    if name is None:
        return None
    from pdcluster.connectors import engine_connector_factory

    return engine_connector_factory


def make_role(name: str, connector_name: str | None = None) -> Any:
    if name == "prefill":
        from pdcluster.prefill_worker import PrefillRole

        return PrefillRole(connector_name)
    if name == "decode":
        from pdcluster.decode_worker import DecodeRole

        return DecodeRole(connector_name)
    from pdcluster.worker.roles import AggregatedRole

    return AggregatedRole(connector_name)


def _tls_config(args: argparse.Namespace) -> Any:
    if not (args.tls_cert or args.tls_key or args.tls_ca):
        return None
    from pdcluster.worker.tls import TLSConfig

    if args.tls_ca and not args.tls_cert:
        raise ValueError("--tls-ca needs --tls-cert and --tls-key")
    return TLSConfig(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca)


def advertise_host(args: argparse.Namespace) -> str:
    """The host peers use to reach this worker: a wildcard bind address is not reachable."""
    if args.advertise_host:
        return args.advertise_host
    return socket.gethostname() if args.host in ("0.0.0.0", "::", "") else args.host


def _kv_events_config(args: argparse.Namespace) -> Any:
    from pdcluster.worker.kv_events import KVEventsConfig

    common = {"bind_host": args.host, "advertise_host": advertise_host(args)}
    if args.key_dir:
        names = [n.strip() for n in args.kv_events_allow.split(",") if n.strip()]
        return KVEventsConfig.from_key_dir(args.key_dir, key_name=args.key_name, allow_names=names, **common)
    cfg = KVEventsConfig.from_env(**common)
    if cfg is None:
        log.warning("no CURVE keys (--key-dir or PDCLUSTER_WORKER_KEY): KV-event publishing is disabled")
    return cfg


async def _serve(args: argparse.Namespace, engine: Any, role: Any, tls: Any, kv_events: Any) -> None:
    from pdcluster.worker.options import DEFAULT_MAX_MESSAGE_BYTES
    from pdcluster.worker.server import start_worker_server

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server, port = await start_worker_server(
        engine, role, args.host, args.port, tls, worker_id=args.worker_id, kv_events=kv_events,
        max_message_bytes=args.max_message_bytes or DEFAULT_MAX_MESSAGE_BYTES)
    kv = server.servicer.kv_events_info()
    ready = {
        "worker_id": server.worker_id, "role": role.name, "address": f"{_bracket(advertise_host(args))}:{port}",
        "bind": server.address, "port": port,
        "pid": os.getpid(), "kv_events_endpoint": kv.events_endpoint, "kv_snapshot_endpoint": kv.snapshot_endpoint,
        "kv_events_public_key": kv.public_key.decode(), "epoch": server.servicer.epoch, "tls": tls is not None,
    }
    sys.stdout.write(f"{READY_PREFIX} {json.dumps(ready, separators=(',', ':'))}\n")
    sys.stdout.flush()
    log.info("worker %s (%s) serving on %s", server.worker_id, role.name, server.address)
    await stop.wait()
    log.info("shutting down")
    await server.stop(grace=2.0)


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def parse_ready_line(line: str) -> dict[str, Any] | None:
    """The readiness payload of a `PDCLUSTER_READY {...}` line, or None for any other line."""
    if not line.startswith(READY_PREFIX + " "):
        return None
    return json.loads(line[len(READY_PREFIX) + 1:])
