"""`pdcluster serve` (workers + router on this machine) and `pdcluster router` (the router alone).

    pdcluster serve [--model PATH] [--workers N] [--grpc-port 50051] [--http-port 8000]
                    [--policy NAME] [--max-inflight N] [--key-dir DIR] [--worker-args "..."]
    pdcluster router --workers HOST:PORT,... [--model PATH] [--policy NAME] [--grpc-port] [--http-port]

Both stay in the foreground, print the endpoints and one machine-readable line

    PDCLUSTER_READY {"grpc": "HOST:PORT", "http": "http://HOST:PORT", "workers": [...],
                     "instances": {NAME: {"role", "address", "pid", "pids", "metrics": URL}}, ...}

and on Ctrl-C / SIGTERM stop everything they started. `serve` runs the router in-process (no
torch in this process: workers are subprocesses) after its N aggregated workers are serving, and
makes the cluster's CURVE keys in a private temporary folder when --key-dir is not given.
This module imports only the standard library at import time (`pdcluster --help` stays fast).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shlex
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdcluster.cluster.local_launcher import WorkerSpec

READY_PREFIX = "PDCLUSTER_READY"
ENV_KV_OPTIONS = "PDCLUSTER_KV_CONNECTOR_OPTIONS"  # what serve-worker reads (cluster/worker_cmd.py)
POLICIES = ("round_robin", "least_loaded", "power_of_two", "prefix_aware")
log = logging.getLogger("pdcluster.serve")


def _add_router_flags(p: argparse.ArgumentParser, *, grpc_port: int = 50051, http_port: int = 8000) -> None:
    p.add_argument("--model", default=None, help="model directory (tokenizer); default: from the workers")
    p.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback; others are explicit)")
    p.add_argument("--grpc-port", type=int, default=grpc_port, help="0 picks a free port")
    p.add_argument("--http-port", type=int, default=http_port, help="0 picks a free port; -1 disables HTTP")
    p.add_argument("--policy", choices=POLICIES, default="prefix_aware")
    p.add_argument("--max-inflight", type=int, default=1024, help="more requests in flight -> RESOURCE_EXHAUSTED")
    p.add_argument("--max-retries", type=int, default=2, help="retries on other workers before the first token")
    p.add_argument("--max-migrations", type=int, default=2,
                   help="after the first token: times a request whose worker failed is resumed on another (0: off)")
    p.add_argument("--stall-timeout", type=float, default=0.0,
                   help="after the first token: seconds without output after which a worker counts as failed "
                        "and the request migrates (0: wait for the deadline)")
    p.add_argument("--health-interval", type=float, default=1.0, help="seconds between worker health checks")
    p.add_argument("--request-timeout", type=float, default=600.0, help="deadline of requests that bring none")
    p.add_argument("--key-dir", default=None, help="cluster keys (`pdcluster keys init`): KV events for prefix_aware")
    a = p.add_argument_group("client access")
    a.add_argument("--api-key", default=None,
                   help="clients must send 'Authorization: Bearer KEY' (HTTP /v1/*) or the same 'authorization' "
                        "metadata (gRPC); default $PDCLUSTER_API_KEY (an environment variable stays out of `ps`)")
    a.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback --host with neither TLS nor an API key (refused otherwise)")
    g = p.add_argument_group("TLS")
    g.add_argument("--tls-cert", "--ssl-certfile", dest="tls_cert", default=None,
                   help="PEM certificate of the router's gRPC and HTTPS frontends")
    g.add_argument("--tls-key", "--ssl-keyfile", dest="tls_key", default=None)
    g.add_argument("--tls-ca", "--ssl-ca-certs", dest="tls_ca", default=None,
                   help="CA of client certificates: turns on mutual TLS")
    g.add_argument("--worker-tls-ca", default=None, help="CA of the workers' certificates: TLS to the workers")
    g.add_argument("--worker-tls-cert", default=None, help="client certificate for workers that require mTLS")
    g.add_argument("--worker-tls-key", default=None)
    g.add_argument("--worker-tls-server-name", default=None)
    g.add_argument("--insecure-internal", action="store_true",
                   help="serve: plaintext gRPC between the router and its loopback workers instead of mutual TLS "
                        "under a CA made for the run (the default when no --worker-tls-* is given)")
    p.add_argument("--disagg-threshold", type=int, default=0,
                   help="conditional disaggregation: prompts whose uncached part is at most this many tokens "
                        "are served entirely by a decode worker (0: always disaggregate when both pools exist)")
    p.add_argument("--worker-channel", choices=("stream", "call"), default="stream",
                   help="stream: every request to a worker over one multiplexed stream (default); "
                        "call: one gRPC call per request")
    b = p.add_argument_group("request bounds")
    b.add_argument("--max-stop-token-ids", type=int, default=None, help="per request (default 64)")
    b.add_argument("--max-json-depth", type=int, default=None, help="nesting of HTTP bodies (default 32)")
    b.add_argument("--max-message-bytes", type=int, default=None, help="gRPC messages and HTTP bodies (default 4 MiB)")
    b.add_argument("--params-cache-bytes", type=int, default=None, help="memo of validated sampling parameters")
    b.add_argument("--max-concurrent-streams", type=int, default=None,
                   help="gRPC calls at once on one client connection (default max-inflight + 64)")
    b.add_argument("--max-http-connections-per-peer", type=int, default=None,
                   help="HTTP connections one client address may hold (default max-inflight + 64; more: 503)")
    b.add_argument("--max-http-requests-per-peer", type=int, default=None,
                   help="HTTP requests one client address may run at once (default max-inflight + 64; more: 429)")
    b.add_argument("--max-images-per-request", type=int, default=None, help="image parts per chat (default 8)")
    b.add_argument("--max-image-bytes", type=int, default=None, help="bytes of one decoded image (default 20 MiB)")
    p.add_argument("--log-level", default="INFO")


_BOUNDS = ("max_stop_token_ids", "max_json_depth", "max_message_bytes", "params_cache_bytes",
           "max_concurrent_streams", "max_images_per_request", "max_image_bytes",
           "max_http_connections_per_peer", "max_http_requests_per_peer")


def add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="start a router and its workers as local processes (development; "
                                     "`pdcluster up` launches on Ray)")
    _add_router_flags(p)
    p.add_argument("--workers", type=int, default=None, help="number of aggregated workers (default 1)")
    p.add_argument("--prefill", type=int, default=0, help="prefill workers (disaggregated; needs --decode)")
    p.add_argument("--decode", type=int, default=0, help="decode workers (disaggregated; needs --prefill)")
    p.add_argument("--encode", type=int, default=0,
                   help="encode workers (multimodal models: encoder-only instances the router sends images to "
                        "first; with --prefill/--decode or aggregated --workers)")
    p.add_argument("--ec-connector", default="auto",
                   help="encoder-cache connector between the instances: auto (p2p_ec for a multimodal model, "
                        "none otherwise), none, p2p_ec or a plugin")
    p.add_argument("--connector", default="p2p", help="KV connector between the pools (p2p, store, plugin)")
    p.add_argument("--kvstore-node-size", default="1G",
                   help="--connector store: shared-memory bytes of the kvstore node started beside the workers")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size of aggregated workers")
    p.add_argument("--prefill-tp", type=int, default=1, help="tensor-parallel size of prefill workers")
    p.add_argument("--decode-tp", type=int, default=1, help="tensor-parallel size of decode workers")
    p.add_argument("--worker-args", default="", help="extra serve-worker flags (after the engine flags, so they "
                   "win), e.g. \"--kv-connector-options '{...}'\"")
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for each worker")
    p.add_argument("--pin-cpus", action="store_true",
                   help="give each worker cores of its own (disjoint slices of this process's CPUs, one core per "
                        "TP rank at least), so prefill and decode do not compete for the same cores")
    p.add_argument("--demo-request", action="store_true",
                   help="once ready, stream one demo request through the router (the README's main job)")
    from pdcluster.cluster.worker_flags import add_forwarded_engine_flags

    add_forwarded_engine_flags(p)
    p.set_defaults(func=run_serve)


def add_router(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("router", help="run the router alone in front of running workers")
    p.add_argument("--workers", required=True, help="comma-separated HOST:PORT of the workers")
    _add_router_flags(p)
    p.set_defaults(func=run_router)


def _router_config(args: argparse.Namespace, workers: tuple[str, ...], key_dir: str | None, model: str | None) -> Any:
    from pdcluster.router.config import RouterConfig
    from pdcluster.worker.tls import TLSConfig

    tls = worker_tls = None
    if args.tls_cert or args.tls_key or args.tls_ca:
        tls = TLSConfig(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca)
    if args.worker_tls_ca or args.worker_tls_cert or args.worker_tls_key:
        worker_tls = TLSConfig(cert=args.worker_tls_cert, key=args.worker_tls_key, ca=args.worker_tls_ca,
                               server_name=args.worker_tls_server_name)

    import os

    bounds = {name: getattr(args, name) for name in _BOUNDS if getattr(args, name) is not None}
    api_key = args.api_key or os.environ.get("PDCLUSTER_API_KEY") or None
    return RouterConfig(
        api_key=api_key, insecure=args.insecure, **bounds,
        workers=workers, model=model, served_model_name=args.served_model_name, policy=args.policy,
        host=args.host, grpc_port=args.grpc_port, http_port=None if args.http_port < 0 else args.http_port,
        max_inflight=args.max_inflight, max_retries=args.max_retries, max_migrations=args.max_migrations,
        stall_timeout_s=args.stall_timeout,
        health_interval_s=args.health_interval,
        request_timeout_s=args.request_timeout, key_dir=key_dir, tls=tls, worker_tls=worker_tls,
        disagg_min_uncached_tokens=args.disagg_threshold, worker_channel=args.worker_channel)


def _check_exposure(args: argparse.Namespace) -> None:
    """Before anything starts: a non-loopback --host needs TLS, an API key or --insecure."""
    import os

    from pdcluster.router.auth import check_exposure

    check_exposure(args.host, tls=bool(args.tls_cert), insecure=args.insecure,
                   api_key=bool(args.api_key or os.environ.get("PDCLUSTER_API_KEY")))


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


# -- pdcluster router -------------------------------------------------------------------------
def run_router(args: argparse.Namespace) -> int:
    _setup_logging(args.log_level)
    _check_exposure(args)
    from pdcluster.router.config import parse_worker_list

    config = _router_config(args, parse_worker_list(args.workers), args.key_dir, args.model)
    return _run_router_foreground(config, wait_for_workers=0)


DEMO_PROMPT = "The prefill pool reads the whole prompt"


async def demo_request(grpc_address: str, api_key: str | None = None) -> None:
    """Stream one request through the router with the real client, as a user would."""
    from pdcluster.client import AsyncClient, ClientError
    from pdcluster.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.8, top_p=0.95, seed=0, max_tokens=48, ignore_eos=True)
    print(f"\ndemo request via {grpc_address}:\n{DEMO_PROMPT}", end="", flush=True)
    try:
        async with AsyncClient(grpc_address, timeout=120.0, api_key=api_key) as client:
            async for delta in client.generate_stream(DEMO_PROMPT, params):
                print(delta.text, end="", flush=True)
    except ClientError as e:
        print(f"\ndemo request failed: {e}", file=sys.stderr)
        return
    print("\n(cluster stays up; Ctrl-C stops it)", flush=True)


def _run_router_foreground(config: Any, *, wait_for_workers: int, launcher: Any = None,
                           send_demo: bool = False, ready_extra: dict[str, Any] | None = None) -> int:
    import asyncio
    import signal

    from pdcluster.router.app import Router

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        router = Router(config)
        await router.start()
        try:
            if wait_for_workers:
                await router.registry.wait_for_healthy(wait_for_workers, 30.0)
            _print_ready(router, launcher, ready_extra)
            if send_demo:
                await demo_request(router.endpoints()["grpc"], config.api_key)
            while not stop.is_set():
                try:
                    await asyncio.wait_for(stop.wait(), 1.0)
                except asyncio.TimeoutError:
                    pass
                for p in launcher.newly_exited() if launcher is not None else ():
                    log.error("%s (pid %d) exited unexpectedly: %s", p.name, p.pid, p.status())
            log.info("shutting down")
        finally:
            await router.stop()

    asyncio.run(main())
    return 0


def _print_ready(router: Any, launcher: Any, extra: dict[str, Any] | None = None) -> None:
    ep = router.endpoints()
    if launcher is not None:
        ep["worker_pids"] = [p.pid for p in launcher.processes]
        ep["instances"] = {p.name: p.summary() for p in launcher.processes}
    ep.update(extra or {})
    print(f"pdcluster router: gRPC {ep['grpc']}" + (f", OpenAI HTTP {ep['http']}/v1" if ep["http"] else ""))
    print(f"  model {ep['model']!r}, policy {ep['policy']}, workers {', '.join(ep['workers'])}")
    print(f"{READY_PREFIX} {json.dumps(ep, separators=(',', ':'))}", flush=True)


# -- pdcluster serve --------------------------------------------------------------------------
def run_serve(args: argparse.Namespace) -> int:
    import shutil
    import signal
    import tempfile

    from pdcluster.cluster.local_launcher import LaunchError, LocalLauncher, WorkerSpec
    from pdcluster.cluster.worker_flags import engine_argv, forwarded_engine, worker_flag_actions

    _setup_logging(args.log_level)
    _check_exposure(args)
    # Until the router's loop installs its own handlers, SIGTERM unwinds through `finally`
    # (stopping the workers) instead of killing this process on the spot.
    signal.signal(signal.SIGTERM, _raise_system_exit)
    model = args.model or _demo_model()
    # Private to this user (mode 0700): generated keys, and the kvstore's logs for --connector store.
    workdir = tempfile.mkdtemp(prefix="pdcluster-serve-")
    key_dir = args.key_dir
    pools = _pools(args)
    names = [f"{role}-{i}" for role, count in pools for i in range(count)]
    own_keys = True  # one CURVE pair per worker instance, named like it
    if key_dir is None:
        from pdcluster.security.keys import init_keys

        key_dir = init_keys(f"{workdir}/keys", ("router", "worker", "client", *names)).root.as_posix()
    else:
        own_keys = _instance_keys(key_dir, names)
    extra = shlex.split(args.worker_args)
    # No worker certificates given: mutual TLS with a CA made for this run (cluster/internal_tls.py).
    given_tls = bool(args.worker_tls_ca or args.worker_tls_cert or args.worker_tls_key)
    internal_ca = None if given_tls or getattr(args, "insecure_internal", False) else _internal_ca(workdir)
    try:
        env, stores, ready_extra = _connector_env(args, pools, workdir, internal_ca)
    except (RuntimeError, OSError) as e:
        print(f"pdcluster serve: error: {e}", file=sys.stderr)
        shutil.rmtree(workdir, ignore_errors=True)
        return 1
    launcher = LocalLauncher(ready_timeout_s=args.ready_timeout, env=env)
    specs = []
    tp_of = {"both": args.tp, "prefill": args.prefill_tp, "decode": args.decode_tp, "encode": 1}
    actions = worker_flag_actions()
    ec = ec_connector_choice(args.ec_connector, model, pools)
    for role, count in pools:
        connector = [] if role in ("both", "encode") else ["--kv-connector", args.connector]
        connector += ["--ec-connector", ec or "none"]
        connector += ["--tp", str(tp_of[role]), *engine_argv(forwarded_engine(args, role), actions)]
        # Workers are internal: loopback whatever --host says (the router, beside them, is the
        # only client-facing port of `serve`).
        specs += [WorkerSpec(f"{role}-{i}", ["--role", role, "--host", "127.0.0.1", "--port", "0", "--model", model,
                                             "--worker-id", f"{role}-{i}", "--key-dir", key_dir, *connector,
                                             *(["--key-name", f"{role}-{i}"] if own_keys else []),
                                             *_worker_tls_argv(internal_ca, f"{role}-{i}"), *extra],
                             # An encode worker runs no KV connector: the pools' KV secrets are not its business.
                             env={ENV_KV_OPTIONS: ""} if role == "encode" else {})
                  for i in range(count)]
    try:
        try:
            if args.pin_cpus:
                specs = _pinned(specs, [tp_of[spec.name.rsplit("-", 1)[0]] for spec in specs])
            workers = launcher.start(specs)
        except (LaunchError, ValueError) as e:
            print(f"pdcluster serve: error: {e}", file=sys.stderr)
            return 1
        addresses = tuple(p.address for p in workers)
        config = _router_config(args, addresses, key_dir, model)
        if internal_ca is not None:
            import dataclasses

            from pdcluster.cluster.internal_tls import client_tls

            config = dataclasses.replace(config, worker_tls=client_tls(internal_ca.issue("router", "router")))
        return _run_router_foreground(config, wait_for_workers=len(addresses), launcher=launcher,
                                      send_demo=args.demo_request, ready_extra=ready_extra)
    finally:
        launcher.stop()
        if stores is not None:
            stores.stop()  # after the workers: they flush nothing more into it
        shutil.rmtree(workdir, ignore_errors=True)


def _pinned(specs: list[WorkerSpec], tps: list[int]) -> list[WorkerSpec]:
    """Each worker pinned to its own slice of our CPUs ($PDCLUSTER_CPUS, cluster/cpu_pinning.py)."""
    from pdcluster.cluster.cpu_pinning import ENV_CPUS, format_cpu_list, partition

    slices = partition(sorted(os.sched_getaffinity(0)), tps)
    for spec, cpus in zip(specs, slices):
        log.info("%s pinned to CPUs %s", spec.name, format_cpu_list(cpus))
    return [dataclasses.replace(spec, env={**spec.env, ENV_CPUS: format_cpu_list(cpus)})
            for spec, cpus in zip(specs, slices)]


def _instance_keys(key_dir: str, names: list[str]) -> bool:
    """The instances' own pairs in the user's key folder (made there when missing, like `keys
    issue` does for certificates); False: they share its "worker" pair (read-only folder)."""
    from pdcluster.security.keys import KeyMaterialError, ensure_instance_keys

    try:
        ensure_instance_keys(key_dir, names)
    except (OSError, KeyMaterialError) as e:
        log.warning("workers share the 'worker' key pair of %s (no per-instance pairs: %s)", key_dir, e)
        return False
    return True


def _internal_ca(workdir: str) -> Any:
    from pdcluster.cluster.internal_tls import make_internal_pki

    return make_internal_pki(workdir)


def _worker_tls_argv(ca: Any, name: str) -> list[str]:
    if ca is None:
        return []
    from pdcluster.cluster.internal_tls import server_argv

    return server_argv(ca.issue("worker", name))


def _connector_env(args: argparse.Namespace, pools: list[tuple[str, int]],
                   workdir: str, ca: Any = None) -> tuple[dict[str, str], Any, dict[str, Any]]:
    """The workers' environment for the pools' KV connector, the store processes started for it
    (or None), and what the ready line adds. Secrets and addresses reach the workers through the
    environment, never a command line."""
    if all(role in ("both", "encode") for role, _ in pools):  # no KV hand-off between pools
        return {}, None, {}
    if args.connector == "p2p":
        import secrets

        # Producers sign the side-channel endpoint they put in kv_transfer_params with this secret.
        return {"PDCLUSTER_KV_CONNECTOR_OPTIONS": json.dumps({"params_secret": secrets.token_hex(32)})}, None, {}
    if args.connector == "store":
        from pdcluster.cluster.store_procs import LocalStores

        stores = LocalStores(f"{workdir}/kvstore")  # master + one node on 127.0.0.1, logs here
        try:
            master = stores.kvstore(node_size=args.kvstore_node_size, ca=ca)  # ca: mutual TLS
        except BaseException:
            stores.stop()
            raise
        log.info("kvstore master %s (logs: %s)", master, stores.workdir)
        # Every instance sharing this store is one of ours: name their TP sizes so blocks are cut
        # into as few shards as they need (the connector's default assumes TP 1, 2, 4 and 8).
        import secrets

        # object_key: the workers' store key; each object is MACed under it at put and checked at
        # every get (kvstore/object_mac.py). Only the workers get it, never the master or the node.
        options = {"master": master, "tp_sizes": sorted({args.prefill_tp, args.decode_tp}),
                   "object_key": secrets.token_hex(32)}
        if ca is not None:  # each worker reaches the master with its own certificate
            options["tls_identity"] = "worker"
        return {"PDCLUSTER_KV_CONNECTOR_OPTIONS": json.dumps(options)}, stores, {"kvstore_master": master}
    return {}, None, {}  # a plugin: its options come from --worker-args / the environment


def ec_connector_choice(name: str, model: str, pools: list[tuple[str, int]]) -> str:
    """The EC connector the workers run ("" = none): `auto` is p2p_ec for a multimodal model (its
    config.json has a vision_config) when instances can share (an encode pool, or two or more
    instances that encode), none otherwise."""
    if name == "none":
        if any(role == "encode" for role, _ in pools):
            raise ValueError("--encode needs an EC connector (--ec-connector auto or p2p_ec), not none")
        return ""
    if name != "auto":
        return name
    encoders = sum(count for role, count in pools if role in ("encode", "prefill", "both"))
    if not any(role == "encode" for role, _ in pools) and encoders < 2:
        return ""
    return "p2p_ec" if _is_multimodal(model) else ""


def _is_multimodal(model: str) -> bool:
    import pathlib

    try:
        config = json.loads((pathlib.Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("vision_config"), dict)


def _pools(args: argparse.Namespace) -> list[tuple[str, int]]:
    """[(role, count)]: an encode pool (if any), then one aggregated pool, or a prefill pool and a
    decode pool."""
    encode = getattr(args, "encode", 0) or 0
    if encode < 0:
        raise ValueError(f"--encode must be at least 0, got {encode}")
    head = [("encode", encode)] if encode else []
    if args.prefill or args.decode:
        if args.workers is not None:
            raise ValueError("--workers (aggregated) cannot be combined with --prefill/--decode")
        if args.prefill < 1 or args.decode < 1:
            raise ValueError(f"--prefill and --decode must both be at least 1, got {args.prefill} and {args.decode}")
        return [*head, ("prefill", args.prefill), ("decode", args.decode)]
    for name in ("tp", "prefill_tp", "decode_tp"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    workers = 1 if args.workers is None else args.workers
    if workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}")
    return [*head, ("both", workers)]


def _raise_system_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _demo_model() -> str:
    """The demo model's path, written by a subprocess if missing: writing its weights needs
    torch, which this (router) process never imports."""
    import subprocess

    from pdcluster.models.demo import demo_model_dir

    path = demo_model_dir()
    if not (path / "model.safetensors").exists():
        subprocess.run([sys.executable, "-m", "pdcluster.cluster.cli", "demo-model"], check=True,
                       stdout=subprocess.DEVNULL)
    return str(path)
