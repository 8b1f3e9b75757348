"""`pdcluster serve-worker`: run one engine behind the Worker gRPC service.

    pdcluster serve-worker --role prefill|decode|both|encode [--model PATH] [--host 127.0.0.1] [--port 0]
        [--worker-id ID] [--key-dir DIR] [--tls-cert F --tls-key F [--tls-ca F]] [--tp T] [engine flags]

Once serving it prints exactly one line to stdout, for launchers to wait on:

    PDCLUSTER_READY {"worker_id": ..., "role": ..., "address": "HOST:PORT", "bind": "HOST:PORT",
                     "port": ..., "pid": ..., "kv_events_endpoint": ..., "kv_snapshot_endpoint": ...,
                     "kv_events_public_key": ..., "epoch": ..., "tls": ..., "metrics": "http://HOST:PORT/metrics"}

(one line of JSON). `address` is what peers dial (--advertise-host, else --host), `bind` what the
server bound; worker_id defaults to ROLE@BIND; the KV-event fields are "" when no keys were
given; `metrics` is the Prometheus endpoint's URL ("" with --metrics-port -1). Logs go to stderr.
SIGTERM / SIGINT: health NOT_SERVING, abort every request, close the sockets, exit 0.

This module only parses flags: the worker itself is assembled by pdcluster.worker.assembly.
`python -m pdcluster.prefill_worker` / `.decode_worker` / `.encode_worker` run `main()` with the role fixed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from pdcluster.cluster.worker_flags import add_engine_flags, engine_kwargs

READY_PREFIX = "PDCLUSTER_READY"
ENV_KV_OPTIONS = "PDCLUSTER_KV_CONNECTOR_OPTIONS"
ENV_EC_OPTIONS = "PDCLUSTER_EC_CONNECTOR_OPTIONS"
# The role names serve-worker offers (pdcluster.worker.role_registry.BUILTIN_ROLES), spelled out
# so building the parser imports nothing.
ROLE_NAMES = ("prefill", "decode", "both", "encode")


def add_serve_worker(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve-worker", help="serve one engine over gRPC as a prefill, decode, aggregated or encode worker")
    add_worker_flags(p)


def add_worker_flags(p: argparse.ArgumentParser, role: str | None = None) -> None:
    """serve-worker's flags on p; with `role`, the role is fixed and --role is not offered."""
    if role is None:
        p.add_argument("--role", choices=ROLE_NAMES, default="both")
    else:
        p.set_defaults(role=role)
    p.add_argument("--model", default=None, help="local HF model directory (default: the built-in demo model)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback; others are explicit)")
    p.add_argument("--port", type=int, default=0, help="gRPC port; 0 picks a free one (printed when ready)")
    p.add_argument("--advertise-host", default=None,
                   help="host peers use to reach this worker (default: --host, or the hostname for 0.0.0.0)")
    p.add_argument("--worker-id", default=None)
    p.add_argument("--max-message-bytes", type=int, default=None)
    p.add_argument("--metrics-host", default="127.0.0.1", help="bind address of the Prometheus endpoint (default loopback)")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="Prometheus endpoint port; 0 picks a free one (its URL is in the ready line), -1 turns it off")
    p.add_argument("--drain-timeout", type=float, default=10.0,
                   help="SIGTERM: seconds running requests may finish (new ones are refused) before the rest "
                        "end with UNAVAILABLE so a router resumes them on another worker")
    g = p.add_argument_group("security")
    g.add_argument("--key-dir", default=None, help="keys made by `pdcluster keys init DIR` (enables KV events); "
                   "or set PDCLUSTER_WORKER_KEY and PDCLUSTER_KV_EVENTS_ALLOWED")
    g.add_argument("--key-name", default="worker", help="this worker's key pair in --key-dir")
    g.add_argument("--kv-events-allow", default="router", help="comma-separated key names allowed to subscribe")
    g.add_argument("--tls-cert", default=None)
    g.add_argument("--tls-key", default=None)
    g.add_argument("--tls-ca", default=None, help="CA of client certificates: turns on mutual TLS")
    e = p.add_argument_group("engine (vLLM's flag names)")
    add_engine_flags(e)
    e.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1,
                   help="tensor-parallel ranks (one process each; rank 0 serves, the others are its children)")
    c = p.add_argument_group("kv connector (disaggregated roles)")
    c.add_argument("--kv-connector", default=None,
                   help="p2p | store | an entry-point name | pkg.module:Class (prefill/decode roles need one)")
    c.add_argument("--kv-connector-options", default=None,
                   help="JSON object of connector options, merged over $PDCLUSTER_KV_CONNECTOR_OPTIONS "
                        "(put secrets in the environment: command lines are world-readable)")
    m = p.add_argument_group("encoder cache (EC) connector (multimodal models)")
    m.add_argument("--ec-connector", default=None,
                   help="p2p_ec | a plugin | none: share encoder outputs with other instances "
                        "(default: p2p_ec on an encode worker, none otherwise)")
    m.add_argument("--ec-connector-options", default=None,
                   help="JSON object of EC connector options, merged over $PDCLUSTER_EC_CONNECTOR_OPTIONS")
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=run_serve_worker)


def run_serve_worker(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from pdcluster.cluster.cpu_pinning import apply_from_env

    cpus = apply_from_env()  # before torch starts its thread pool (it sizes it from the mask)
    if cpus is not None:
        logging.getLogger(__name__).info("pinned to CPUs %s", ",".join(map(str, cpus)))
    from pdcluster.worker.assembly import run_worker

    config = worker_config(args)
    run_worker(config, lambda server, port, metrics_url: _announce(config, server, port, metrics_url))
    return 0


def main(argv: Sequence[str] | None = None, *, role: str, prog: str) -> int:
    """One worker with its role fixed (the role packages' `python -m`)."""
    parser = argparse.ArgumentParser(prog=prog, description=f"serve one engine over gRPC as a {role} worker")
    add_worker_flags(parser, role=role)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, FileExistsError, PermissionError) as e:  # as `pdcluster` does
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


def worker_config(args: argparse.Namespace) -> Any:
    """The flags as a pdcluster.worker.assembly.WorkerConfig."""
    from pdcluster.worker.assembly import WorkerConfig

    return WorkerConfig(
        role=args.role, host=args.host, port=args.port, advertise_host=args.advertise_host,
        worker_id=args.worker_id, max_message_bytes=args.max_message_bytes, key_dir=args.key_dir,
        drain_timeout_s=args.drain_timeout,
        key_name=args.key_name, kv_events_allow=tuple(n.strip() for n in args.kv_events_allow.split(",") if n.strip()),
        tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca, kv_connector=args.kv_connector,
        metrics_host=args.metrics_host, metrics_port=None if args.metrics_port < 0 else args.metrics_port,
        kv_connector_options=_options(args.kv_connector_options, ENV_KV_OPTIONS, "--kv-connector-options"),
        ec_connector=None if args.ec_connector is None else ("" if args.ec_connector == "none" else args.ec_connector),
        ec_connector_options=_options(args.ec_connector_options, ENV_EC_OPTIONS, "--ec-connector-options"),
        engine=dict(
            model=args.model, **engine_kwargs(args), tensor_parallel_size=args.tp))


def _options(flag_value: str | None, env: str, flag: str) -> dict[str, Any]:
    """$ENV, then the flag's JSON object over it (connector options: KV or EC)."""
    options: dict[str, Any] = {}
    for source, text in (("$" + env, os.environ.get(env)), (flag, flag_value)):
        if text:
            try:
                value = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{source}: not valid JSON ({e.msg})") from None
            if not isinstance(value, dict):
                raise ValueError(f"{source}: must be a JSON object")
            options.update(value)
    return options


def _announce(config: Any, server: Any, port: int, metrics_url: str = "") -> None:
    """The READY line launchers wait on (see the module docstring)."""
    from pdcluster.worker.assembly import advertise_host

    kv = server.servicer.kv_events_info()
    ready = {
        "worker_id": server.worker_id, "role": server.servicer.role.name,
        "address": f"{_bracket(advertise_host(config))}:{port}", "bind": server.address, "port": port,
        "pid": os.getpid(), "kv_events_endpoint": kv.events_endpoint, "kv_snapshot_endpoint": kv.snapshot_endpoint,
        "kv_events_public_key": kv.public_key.decode(), "epoch": server.servicer.epoch,
        "tls": config.tls_cert is not None or config.tls_key is not None or config.tls_ca is not None,
        "metrics": metrics_url,
    }
    sys.stdout.write(f"{READY_PREFIX} {json.dumps(ready, separators=(',', ':'))}\n")
    sys.stdout.flush()


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def parse_ready_line(line: str) -> dict[str, Any] | None:
    """The readiness payload of a `PDCLUSTER_READY {...}` line, or None for any other line."""
    if not line.startswith(READY_PREFIX + " "):
        return None
    return json.loads(line[len(READY_PREFIX) + 1:])
