"""`pdcluster serve`: workers + router on this machine (`pdcluster router` alone: router_cmd.py).

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

from pdcluster.cluster.router_cmd import (
    add_router_flags,
    check_router_flags,
    router_config,
    run_router_foreground,
    setup_logging,
)

if TYPE_CHECKING:
    from pdcluster.cluster.local_launcher import WorkerSpec

ENV_KV_OPTIONS = "PDCLUSTER_KV_CONNECTOR_OPTIONS"  # what serve-worker reads (cluster/worker_cmd.py)
log = logging.getLogger("pdcluster.serve")


def add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="start a router and its workers as local processes (development; "
                                     "`pdcluster up` launches on Ray)")
    add_router_flags(p)
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
    p.add_argument("--tp", "--tensor-parallel-size", "-tp", dest="tp", type=int, default=1,
                   help="tensor-parallel size of aggregated workers")
    p.add_argument("--prefill-tp", type=int, default=1, help="tensor-parallel size of prefill workers")
    p.add_argument("--decode-tp", type=int, default=1, help="tensor-parallel size of decode workers")
    p.add_argument("--worker-args", default="", help="extra serve-worker flags (after the engine flags, so they "
                   "win), e.g. \"--kv-connector-options '{...}'\"")
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for each worker")
    p.add_argument("--pin-cpus", action="store_true",
                   help="give each worker cores of its own (disjoint slices of this process's CPUs, one core per "
                        "TP rank at least), so prefill and decode do not compete for the same cores")
    # auto by default: with every worker's engine on one thread (async_engine), each worker's OpenMP
    # pool spin-waits at full speed, so pools that share cores must not oversubscribe them (1P+1D on
    # 2 cores: TPOT 28 ms with auto vs 63 ms with every worker at 2 threads; RESULTS.md, session 3).
    p.add_argument("--worker-threads", default="auto", type=_worker_threads_flag,
                   help="torch threads of each worker TP rank: auto (default) = this process's CPUs split evenly "
                        "between all the workers' ranks, at least 1 each, so the workers' thread pools do not "
                        "oversubscribe the cores they share; 0 = torch's default (every CPU, in every worker); N = N "
                        "each. Ignored with --pin-cpus (a worker uses its slice) and when PDCLUSTER_NUM_THREADS or "
                        "OMP_NUM_THREADS is set (yours wins)")
    p.add_argument("--demo-request", action="store_true",
                   help="once ready, stream one demo request through the router (the README's main job)")
    from pdcluster.cluster.worker_flags import add_forwarded_engine_flags

    add_forwarded_engine_flags(p)
    p.set_defaults(func=run_serve)


# -- pdcluster serve --------------------------------------------------------------------------
def run_serve(args: argparse.Namespace) -> int:
    import shutil
    import signal
    import tempfile

    from pdcluster.cluster.local_launcher import LaunchError, LocalLauncher, WorkerSpec
    from pdcluster.cluster.worker_flags import engine_argv, forwarded_engine, worker_flag_actions

    setup_logging(args.log_level)
    check_router_flags(args)
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
    # grace: a worker's SIGTERM drain (serve-worker --drain-timeout, 10 s) plus time to exit
    launcher = LocalLauncher(ready_timeout_s=args.ready_timeout, env=env, grace_s=_drain_timeout(extra) + 10.0)
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
            tps = [tp_of[spec.name.rsplit("-", 1)[0]] for spec in specs]
            if args.pin_cpus:
                specs = _pinned(specs, tps)
            else:
                specs = _threaded(specs, tps, getattr(args, "worker_threads", "0"))
            workers = launcher.start(specs)
        except (LaunchError, ValueError) as e:
            print(f"pdcluster serve: error: {e}", file=sys.stderr)
            return 1
        addresses = tuple(p.address for p in workers)
        config = router_config(args, addresses, key_dir, model)
        if internal_ca is not None:
            import dataclasses

            from pdcluster.cluster.internal_tls import client_tls

            config = dataclasses.replace(config, worker_tls=client_tls(internal_ca.issue("router", "router")))
        return run_router_foreground(config, wait_for_workers=len(addresses), launcher=launcher,
                                      send_demo=args.demo_request, ready_extra=ready_extra)
    finally:
        launcher.stop()
        if stores is not None:
            stores.stop()  # after the workers: they flush nothing more into it
        shutil.rmtree(workdir, ignore_errors=True)


def _drain_timeout(worker_args: list[str]) -> float:
    """The --drain-timeout the workers were given in --worker-args (serve-worker's default: 10 s)."""
    for i, arg in enumerate(worker_args):
        value = arg.split("=", 1)[1] if arg.startswith("--drain-timeout=") else (
            worker_args[i + 1] if arg == "--drain-timeout" and i + 1 < len(worker_args) else None)
        if value is not None:
            try:
                return max(0.0, float(value))
            except ValueError:
                break  # serve-worker refuses it by name when it parses its flags
    return 10.0


def _pinned(specs: list[WorkerSpec], tps: list[int]) -> list[WorkerSpec]:
    """Each worker pinned to its own slice of our CPUs ($PDCLUSTER_CPUS, cluster/cpu_pinning.py)."""
    from pdcluster.cluster.cpu_pinning import ENV_CPUS, format_cpu_list, partition

    slices = partition(sorted(os.sched_getaffinity(0)), tps)
    for spec, cpus in zip(specs, slices):
        log.info("%s pinned to CPUs %s", spec.name, format_cpu_list(cpus))
    return [dataclasses.replace(spec, env={**spec.env, ENV_CPUS: format_cpu_list(cpus)})
            for spec, cpus in zip(specs, slices)]


def _worker_threads_flag(text: str) -> str:
    if text != "auto" and not (text.isdigit() and int(text) >= 0):
        raise argparse.ArgumentTypeError(f"must be auto or a number >= 0, got {text!r}")
    return text


def worker_thread_count(flag: str, tps: list[int], num_cpus: int, environ: Any = None) -> int | None:
    """Torch threads per TP rank `serve` gives its unpinned workers, or None to leave torch's default
    (flag 0, or the user sized the pool through PDCLUSTER_NUM_THREADS / OMP_NUM_THREADS)."""
    from pdcluster.cluster.cpu_pinning import USER_THREAD_VARS, threads_per_rank

    environ = os.environ if environ is None else environ
    if flag == "0" or any(environ.get(name) for name in USER_THREAD_VARS):
        return None
    return int(flag) if flag != "auto" else threads_per_rank(num_cpus, sum(tps))


def _threaded(specs: list[WorkerSpec], tps: list[int], flag: str) -> list[WorkerSpec]:
    """Each worker's torch thread count ($PDCLUSTER_NUM_THREADS), e.g. so the workers' OpenMP teams do not
    oversubscribe the cores they share (cluster/cpu_pinning.threads_per_rank)."""
    from pdcluster.cluster.cpu_pinning import ENV_THREADS

    threads = worker_thread_count(flag, tps, len(os.sched_getaffinity(0)))
    if threads is None:
        return specs
    log.info("workers: %d torch thread(s) per TP rank (--worker-threads %s)", threads, flag)
    return [dataclasses.replace(spec, env={**spec.env, ENV_THREADS: str(threads)}) for spec in specs]


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
            # ca: mutual TLS; /metrics on a loopback port, so its TLS refusals are seen (issue 16)
            master = stores.kvstore(node_size=args.kvstore_node_size, ca=ca, master_args=("--metrics-port", "0"),
                                    node_args=("--metrics-port", "0"))
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
    for flag, unset in (("disagg_threshold", 0), ("disagg_max_prefill_backlog", 0), ("disagg_max_decode_inflight", None)):
        if getattr(args, flag, unset) != unset:  # an aggregated pool never disaggregates: the flag would do nothing
            raise ValueError(f"--{flag.replace('_', '-')} needs --prefill and --decode pools")
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
