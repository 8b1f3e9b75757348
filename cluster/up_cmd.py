"""`pdcluster up`, `pdcluster status`, `pdcluster down`: a cluster on Ray.

    pdcluster up [--config FILE] [--address local|auto|ray://HOST:PORT|HOST:PORT] [--model PATH]
                 [--prefill N --decode M | --workers N] [--encode E] [--tp T] [--connector NAME]
                 [--grpc-port P] [--http-port Q] [--policy NAME] [--namespace NS] [--detach]
                 [--worker-threads auto|0|N] [--disagg-mode sequential|concurrent]
    pdcluster up --reload-keys [--namespace NS] [--key-dir DIR]   (TLS rotation: up_reload.py)
    pdcluster status [--namespace NS] [--json]
    pdcluster down [--namespace NS] [--drain-timeout S]

Flags override the file's fields (cluster/config.py). `up` prints the endpoints and one line

    PDCLUSTER_READY {"grpc": "HOST:PORT", "http": "http://HOST:PORT", "instances": {...}, ...}

then stays in the foreground until Ctrl-C / SIGTERM and stops everything it started; with
--detach it returns once ready and `down` stops the cluster later. Only the standard library is
imported here at import time (`pdcluster --help` stays fast).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Mapping
from typing import Any

from pdcluster.cluster.router_cmd import REASONING_PARSER_NAMES, add_generation_config_flag

READY_PREFIX = "PDCLUSTER_READY"


def add_up_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start a cluster (workers + router) on Ray: local or an existing Ray cluster")
    p.add_argument("--config", default=None, help="cluster YAML (see examples/cluster.yaml)")
    p.add_argument("--address", default=None,
                   help="'local' starts a loopback Ray head (default unless $RAY_ADDRESS is set); 'auto', "
                        "'ray://HOST:PORT' or 'HOST:PORT' join an existing Ray cluster")
    p.add_argument("--model", default=None, help="model directory on every node (default: the demo model)")
    p.add_argument("--prefill", type=int, default=None, help="prefill instances (disaggregated)")
    p.add_argument("--decode", type=int, default=None, help="decode instances (disaggregated)")
    p.add_argument("--workers", type=int, default=None, help="aggregated instances (one `both` pool)")
    p.add_argument("--encode", type=int, default=None,
                   help="encode instances (multimodal models: encoder-only, beside the other pools; 0 removes them)")
    p.add_argument("--ec-connector", default=None, help="encoder-cache connector (p2p_ec, none, a dotted path)")
    p.add_argument("--tp", "--tensor-parallel-size", "-tp", dest="tp", type=int, default=None,
                   help="tensor-parallel size of every pool")
    p.add_argument("--connector", default=None, help="KV connector name or 'package.module:Class'")
    p.add_argument("--grpc-port", type=int, default=None)
    p.add_argument("--http-port", "--port", dest="http_port", type=int, default=None,
                   help="the OpenAI HTTP port (--port: vLLM's name); -1 disables the HTTP frontend")
    p.add_argument("--router-host", default=None, help="router bind address (default 127.0.0.1)")
    p.add_argument("--policy", default=None)
    p.add_argument("--disagg-threshold", dest="disagg_min_uncached_tokens", type=int, default=None,
                   help="conditional disaggregation: prompts whose uncached part is at most this many tokens are "
                        "served by a decode worker alone (router.disagg_min_uncached_tokens; 0: always disaggregate)")
    p.add_argument("--disagg-max-prefill-backlog", dest="disagg_max_prefill_backlog_tokens", type=int, default=None,
                   help="load-aware disaggregation: while the least busy prefill worker has more than this many prompt "
                        "tokens queued, a decode worker prefills the prompts it would finish before the prefill worker "
                        "could start them (router.disagg_max_prefill_backlog_tokens; 0: never)")
    p.add_argument("--disagg-max-decode-inflight", dest="disagg_max_decode_inflight", type=int, default=None,
                   help="with --disagg-max-prefill-backlog: only a decode worker with at most this many requests in "
                        "flight takes such prompts (router.disagg_max_decode_inflight; default: any)")
    p.add_argument("--disagg-mode", choices=("sequential", "concurrent"), default="sequential",
                   help="as `serve`: sequential sends the decode leg once the prefill leg returned (default); "
                        "concurrent sends both at once, the decode worker admits its leg while the prefill runs")
    from pdcluster.cluster.serve_cmd import _worker_threads_flag  # stdlib-only at import: cheap

    p.add_argument("--worker-threads", default="auto", type=_worker_threads_flag,
                   help="as `serve`: torch threads of each worker TP rank: auto (default) = its node's CPUs (Ray's "
                        "count) split evenly between the worker ranks placed on that node; 0 = torch's default; "
                        "N = N each; not set when PDCLUSTER_NUM_THREADS or OMP_NUM_THREADS is set for `up`")
    p.add_argument("--max-migrations", type=int, default=None,
                   help="times a request whose worker failed after its first token is resumed on another (0: off)")
    p.add_argument("--key-dir", default=None, help="cluster keys (`pdcluster keys init`); default: fresh private keys")
    p.add_argument("--log-dir", default=None, help="worker logs, on each node (default: Ray's log folder)")
    p.add_argument("--max-restarts", type=int, default=None, help="Ray restarts of a crashed worker actor")
    p.add_argument("--ready-timeout", dest="ready_timeout_s", type=float, default=None)
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray head (--address local)")
    p.add_argument("--no-dashboard", dest="dashboard", action="store_const", const=False, default=None,
                   help="no Ray dashboard on the local head (saves ~1 GiB; `status` then shows no restarts)")
    _add_namespace(p)
    p.add_argument("--detach", action="store_true", help="return once ready; `pdcluster down` stops it")
    p.add_argument("--insecure", action="store_true",
                   help="join a Ray cluster without token authentication, or bind the router to a non-loopback "
                        "--router-host (it has no TLS or API key under `up` yet)")
    p.add_argument("--insecure-internal", action="store_true",
                   help="plaintext gRPC between the router and the workers instead of mutual TLS with "
                        "certificates from --key-dir's CA or one made for the cluster (the default)")
    p.add_argument("--demo-request", action="store_true",
                   help="once ready, stream one demo request through the router (the README's main job)")
    p.add_argument("--reload-keys", action="store_true",
                   help="start nothing: push the CA of --key-dir (default: the one the cluster of --namespace was "
                        "started with) to its running actors, each its new certificate, after `pdcluster keys "
                        "rotate-ca/reissue/revoke-ca` (a foreground `up` does this itself on SIGHUP or a CA change)")
    add_engine_overrides(p)
    p.set_defaults(func=run_up)
    s = sub.add_parser("status", help="instances, nodes, health and load of a cluster started by `up`")
    _add_namespace(s)
    s.add_argument("--address", default=None, help="Ray address (default: the one `up` recorded)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=run_status)
    d = sub.add_parser("down", help="stop everything `up` started")
    _add_namespace(d)
    d.add_argument("--address", default=None, help="Ray address (default: the one `up` recorded)")
    d.add_argument("--drain-timeout", type=float, default=10.0, metavar="S",
                   help="first drain every worker: requests in flight may finish for up to S seconds "
                        "(the rest end with UNAVAILABLE); 0 ends them at once")
    d.set_defaults(func=run_down)


def _add_namespace(p: argparse.ArgumentParser) -> None:
    p.add_argument("--namespace", default=None, help="Ray namespace of the cluster (default: pdcluster)")


def add_engine_overrides(p: argparse.ArgumentParser) -> None:
    """vLLM's engine flags on `up`: every pool's `engine` section, or one pool's (--prefill-FLAG,
    --decode-FLAG); and the router's --served-model-name and --chat-template."""
    from pdcluster.cluster.worker_flags import add_forwarded_engine_flags

    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="the model name(s) clients use, all listed (default: the model path)")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template file (or the template text) used instead of the model's own")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSER_NAMES, default=None,
                   help="split the model's <think>...</think> thought into message.reasoning (router.reasoning_parser)")
    p.add_argument("--tool-call-parser", default=None,
                   help="how tool_choice auto reads calls out of an answer (router.tool_call_parser; default hermes)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM command lines: tool_choice auto is always served here")
    add_generation_config_flag(p, default=None)
    add_forwarded_engine_flags(p)


_OVERRIDES = ("model", "prefill", "decode", "workers", "encode", "ec_connector", "tp", "connector", "grpc_port", "http_port", "router_host",
              "policy", "key_dir", "log_dir", "max_restarts", "ready_timeout_s", "num_cpus", "namespace", "dashboard",
              "disagg_min_uncached_tokens", "disagg_max_prefill_backlog_tokens", "disagg_max_decode_inflight",
              "max_migrations")


def build_config(args: argparse.Namespace) -> Any:
    from pdcluster.cluster.config import ClusterConfig, load_yaml

    raw = load_yaml(args.config) if args.config else {}
    out = apply_overrides(raw, {k: getattr(args, k) for k in _OVERRIDES})
    return ClusterConfig.from_dict(apply_engine_overrides(out, args))


def apply_engine_overrides(raw: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags given on the command line over each pool's `engine` section."""
    from pdcluster.cluster.worker_flags import forwarded_engine

    pools = raw.get("pools") if raw.get("pools") is not None else {"both": {}}
    if isinstance(pools, Mapping):
        merged = {}
        for role, pool in pools.items():
            engine = forwarded_engine(args, role)
            if engine and isinstance(pool, Mapping | None):
                pool = dict(pool or {})
                pool["engine"] = _merge(pool.get("engine"), **engine)
            merged[role] = pool
        raw = {**raw, "pools": merged}
    for name in ("served_model_name", "chat_template", "reasoning_parser", "tool_call_parser", "generation_config"):
        if getattr(args, name, None) is not None:
            raw = {**raw, "router": _merge(raw.get("router"), **{name: getattr(args, name)})}
    return raw


def apply_overrides(raw: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The file's fields with the command line's on top (None = flag not given). Pool counts:
    `workers` makes the cluster aggregated, `prefill`/`decode` disaggregated; each keeps the
    file's settings of the pool it resizes. Values are validated afterwards, by from_dict."""
    ov = {k: v for k, v in overrides.items() if v is not None}
    if "workers" in ov and ("prefill" in ov or "decode" in ov):
        raise ValueError("--workers (aggregated) cannot be combined with --prefill/--decode")
    out = dict(raw)
    pools = out.get("pools") or {}
    if isinstance(pools, Mapping):
        pools = dict(pools)
        encode = {"encode": pools["encode"]} if "encode" in pools else {}  # kept beside either layout
        if "workers" in ov:
            pools = {"both": _merge(pools.get("both"), instances=ov["workers"]), **encode}
        elif "prefill" in ov or "decode" in ov:
            pools.pop("both", None)
            for role in ("prefill", "decode"):
                if role in ov:
                    pools[role] = _merge(pools.get(role), instances=ov[role])
        if "encode" in ov:
            if ov["encode"] == 0:
                pools.pop("encode", None)
            else:
                pools["encode"] = _merge(pools.get("encode"), instances=ov["encode"])
        per_pool = {k: ov[k] for k in ("tp", "max_restarts") if k in ov}
        pools = {role: _merge(p, **per_pool) for role, p in pools.items()}
        out["pools"] = pools
    router = {k: ov[k] for k in ("grpc_port", "http_port", "policy", "disagg_min_uncached_tokens",
                                 "disagg_max_prefill_backlog_tokens", "disagg_max_decode_inflight",
                                 "max_migrations") if k in ov}
    if "router_host" in ov:
        router["host"] = ov["router_host"]
    if router:
        out["router"] = _merge(out.get("router"), **router)
    if "connector" in ov:
        out["connector"] = _merge(out.get("connector"), name=ov["connector"])
    if "ec_connector" in ov:
        out["ec_connector"] = "none" if ov["ec_connector"] == "none" else \
            _merge(out.get("ec_connector") if isinstance(out.get("ec_connector"), Mapping) else None,
                   name=ov["ec_connector"])
    for key in ("model", "namespace", "key_dir", "log_dir", "ready_timeout_s", "num_cpus", "dashboard"):
        if key in ov:
            out[key] = ov[key]
    return out


def _merge(section: Any, **updates: Any) -> Any:
    """section (a mapping, or None) updated; anything else is left for validation to refuse."""
    if section is None:
        return dict(updates)
    if isinstance(section, str) and "name" in updates:  # `connector: p2p` short form
        return dict(updates)
    return {**section, **updates} if isinstance(section, Mapping) else section


# -- up -----------------------------------------------------------------------------------------
def run_up(args: argparse.Namespace) -> int:
    if getattr(args, "reload_keys", False):
        from pdcluster.cluster.up_reload import run_reload_keys

        return run_reload_keys(args)
    config = build_config(args)  # a config mistake fails here, before anything starts
    _progress_to_stderr()
    from pdcluster.cluster.ray_launcher import LaunchError, RayLauncher

    address = args.address or os.environ.get("RAY_ADDRESS") or "local"
    _check_access(config, address, args.insecure)
    launcher = RayLauncher(config, address=address, **launcher_options(args))
    stop = _StopFlag()
    try:
        try:
            endpoints = launcher.up()
        except LaunchError as e:
            print(f"pdcluster up: error: {e}", file=sys.stderr)
            return 1
        _print_ready(endpoints, args.detach)
        if args.demo_request:
            import asyncio

            from pdcluster.cluster.router_cmd import demo_request

            asyncio.run(demo_request(endpoints["grpc"]))
        if args.detach:
            return 0
        _watch(launcher, stop)
        print("pdcluster up: stopping", file=sys.stderr)
        return 0
    finally:
        if not args.detach:
            launcher.down()


def launcher_options(args: argparse.Namespace) -> dict[str, Any]:
    """RayLauncher's keyword arguments from `up`'s flags."""
    return {"detach": args.detach, "insecure": args.insecure, "insecure_internal": args.insecure_internal,
            "worker_threads": args.worker_threads, "disagg_mode": args.disagg_mode}


def _check_access(config: Any, address: str, insecure: bool) -> None:
    """Before anything starts: the router's bind address, and Ray's authentication (said aloud)."""
    from pdcluster.router.auth import check_exposure

    check_exposure(config.router.host, tls=False, api_key=False, insecure=insecure, what="the router (--router-host)")
    if address == "local":
        print("pdcluster up: a local Ray head on loopback only (127.0.0.1), with token authentication",
              file=sys.stderr)
        return
    from pdcluster.cluster.ray_auth import driver_auth_env, require_token_auth

    print(f"pdcluster up: {require_token_auth(address, insecure=insecure)}", file=sys.stderr)
    os.environ.update(driver_auth_env())  # this CLI process's own driver, before `import ray`


def _progress_to_stderr() -> None:
    import logging

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("pdcluster up: %(message)s"))
    logger = logging.getLogger("pdcluster.ray")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


class _StopFlag:
    """SIGTERM / SIGINT end the foreground loop; during start-up they unwind (and tear down)."""

    def __init__(self) -> None:
        self.set = False
        signal.signal(signal.SIGTERM, self._raise)

    def _raise(self, signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    def arm(self) -> None:
        signal.signal(signal.SIGTERM, self._flag)
        signal.signal(signal.SIGINT, self._flag)

    def _flag(self, signum: int, frame: Any) -> None:
        self.set = True


def _watch(launcher: Any, stop: _StopFlag, interval_s: float = 5.0) -> None:
    """Until a signal: report workers leaving or rejoining the router (crash, restart); push a
    TLS rotation on SIGHUP or a change of --key-dir's CA (up_reload.py)."""
    import ray

    from pdcluster.cluster.up_reload import KeyWatch, maybe_reload

    stop.arm()
    keys = KeyWatch(launcher.tls.key_dir if launcher.tls is not None else None)
    keys.arm()
    last: dict[str, bool] = {}
    next_check = time.monotonic() + interval_s
    while not stop.set:
        time.sleep(0.2)
        if time.monotonic() < next_check and not keys.requested:
            continue
        next_check = time.monotonic() + interval_s
        maybe_reload(launcher, keys)
        try:
            workers = ray.get(launcher.router.workers.remote(), timeout=10)
        except Exception as e:
            print(f"pdcluster up: the router does not answer: {e}", file=sys.stderr)
            continue
        now = {w["name"] or w["address"]: w["healthy"] for w in workers}
        for name, healthy in now.items():
            if last.get(name, True) != healthy:
                print(f"pdcluster up: {name} is {'healthy again' if healthy else 'NOT healthy'}", file=sys.stderr)
        last = now


def _print_ready(ep: Mapping[str, Any], detach: bool) -> None:
    print(f"pdcluster up: gRPC {ep['grpc']}" + (f", OpenAI HTTP {ep['http']}/v1" if ep.get("http") else ""))
    print(f"  model {ep.get('model')!r}, policy {ep.get('policy')}, Ray {ep['ray_address']}, "
          f"namespace {ep['namespace']}")
    for name, w in ep["instances"].items():
        print(f"  {name:<12} {w['address']:<22} node {str(w['node_id'])[:12]} ({w['node_ip']}) "
              f"pid {w['child_pid']}")
    print("  detached: stop it with `pdcluster down" + (f" --namespace {ep['namespace']}`"
          if ep["namespace"] != "pdcluster" else "`") if detach else "  Ctrl-C stops everything")
    print(f"{READY_PREFIX} {json.dumps(dict(ep), separators=(',', ':'), default=str)}", flush=True)


# -- status / down ------------------------------------------------------------------------------
def _connect(args: argparse.Namespace, *, required: bool) -> tuple[str, dict[str, Any] | None, bool]:
    """(namespace, state `up` recorded, connected). Not connected is an error when required."""
    from pdcluster.cluster.ray_head import gcs_reachable, read_state

    ns = args.namespace or "pdcluster"
    state = read_state(ns)
    address = args.address or (state or {}).get("ray_address") or os.environ.get("RAY_ADDRESS") or "auto"
    if state and state.get("ray_auth_mode"):
        os.environ.setdefault("RAY_AUTH_MODE", state["ray_auth_mode"])  # before `import ray`: read at import
    if state and state.get("head_pid") and str(state.get("ray_address", "")).startswith("127.0.0.1:"):
        from pdcluster.cluster.ray_head import use_loopback_node

        use_loopback_node()  # a loopback head: this driver joins it as 127.0.0.1 too
    import ray

    error = None if gcs_reachable(address) else "nothing listens there"
    if error is None:
        try:
            ray.init(address=address, namespace=ns, log_to_driver=False, configure_logging=False)
        except (ConnectionError, RuntimeError) as e:
            error = str(e)
    if error is not None and (required or state is None):
        raise ValueError(f"cannot reach Ray at {address!r} (namespace {ns!r}): {error}")
    if error is not None:
        print(f"pdcluster: cannot reach Ray at {address}: {error}", file=sys.stderr)
    return ns, state, error is None


def run_status(args: argparse.Namespace) -> int:
    ns, _, _ = _connect(args, required=True)
    import ray  # after _connect: it sets RAY_AUTH_MODE, which Ray reads at import

    from pdcluster.cluster.ray_status import collect_status, format_status

    try:
        status = collect_status(ns)
    finally:
        ray.shutdown()
    print(json.dumps(status, indent=1, default=str) if args.json else format_status(status))
    return 0 if status["instances"] else 1


def run_down(args: argparse.Namespace) -> int:
    import shutil

    from pdcluster.cluster import ray_head
    from pdcluster.cluster.ray_teardown import teardown

    ns, state, _ = _connect(args, required=False)
    head = None
    if state and state.get("head_pid"):
        head = ray_head.LocalHead(state["head_pid"], state["ray_address"], "", state.get("head_start", 0.0))
    report = teardown(ns, head=head, drain_timeout_s=max(0.0, args.drain_timeout))
    if state and state.get("key_dir"):
        shutil.rmtree(state["key_dir"], ignore_errors=True)
    ray_head.remove_state(ns)
    drained = report.get("drained") or {}
    if drained:
        finished = sum(r.get("finished", 0) for r in drained.values())
        moved = sum(r.get("moved", 0) for r in drained.values())
        print(f"pdcluster down: drained {len(drained)} worker(s): {finished} request(s) finished, "
              f"{moved} ended at the drain timeout")
    print(f"pdcluster down: stopped {len(report['actors'])} actor(s), removed {len(report['placement_groups'])} "
          f"placement group(s)" + (", stopped the local Ray head" if report["head_stopped"] else ""))
    if report["left"]:
        print(f"pdcluster down: still running: {', '.join(report['left'])}", file=sys.stderr)
        return 1
    return 0
