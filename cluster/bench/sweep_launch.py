"""Start and stop one sweep configuration's cluster, as the CLI a user would type does.

    local: `pdcluster serve ...` as a child process; stopped with SIGTERM (it stops its workers by
           pid), SIGKILL of its process group as a last resort.
    ray:   `pdcluster up --config FILE --detach` (returns once ready), later `pdcluster down`.

Both are context managers yielding the PDCLUSTER_READY record ({"grpc", "http", ...}); leaving the
block stops the cluster, also on an exception or KeyboardInterrupt, so a sweep leaves nothing running.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping
from typing import IO, Any

from pdcluster.cluster.bench.sweep_config import ClusterEntry, SweepConfig

READY_PREFIX = "PDCLUSTER_READY "
CLI = [sys.executable, "-m", "pdcluster.cluster.cli"]


class ClusterStartError(RuntimeError):
    pass


def serve_argv(entry: ClusterEntry) -> list[str]:
    """`pdcluster serve` flags for an entry (free ports, so a sweep never collides with a server)."""
    from pdcluster.cluster.worker_flags import engine_argv, pool_engine_argv, worker_flag, worker_flag_actions

    cluster, pools = entry.cluster, entry.cluster["pools"]
    argv = ["serve", "--grpc-port", "0", "--http-port", "0"]
    if cluster.get("model"):
        argv += ["--model", cluster["model"]]
    if "both" in pools:
        argv += ["--workers", str(pools["both"]["instances"])]
    else:
        argv += ["--prefill", str(pools["prefill"]["instances"]), "--decode", str(pools["decode"]["instances"])]
    router = cluster.get("router", {})
    if router.get("policy"):
        argv += ["--policy", router["policy"]]
    if router.get("disagg_min_uncached_tokens") is not None:
        argv += ["--disagg-threshold", str(router["disagg_min_uncached_tokens"])]
    if router.get("disagg_max_prefill_backlog_tokens") is not None:
        argv += ["--disagg-max-prefill-backlog", str(router["disagg_max_prefill_backlog_tokens"])]
    if router.get("disagg_max_decode_inflight") is not None:
        argv += ["--disagg-max-decode-inflight", str(router["disagg_max_decode_inflight"])]
    if entry.pinned:
        argv.append("--pin-cpus")
    # Options every pool shares go to every worker (--worker-args); a pool's own (decode_engine,
    # prefill_engine) as serve's --decode-FLAG / --prefill-FLAG, which --worker-args would override.
    engines = {role: p.get("engine") or {} for role, p in pools.items()}
    pool = next(iter(pools.values()))
    shared = {k: v for k, v in (pool.get("engine") or {}).items() if all(k in e and e[k] == v for e in engines.values())}
    for role, engine in engines.items():
        if own := {k: v for k, v in engine.items() if k not in shared}:
            argv += pool_engine_argv(role, own)
    actions = worker_flag_actions()
    worker = engine_argv(shared, actions)
    if pool.get("tp", 1) > 1:
        flag = worker_flag(actions, "tp")
        if flag is None:
            raise ClusterStartError(f"configs.{entry.name}.tp: serve-worker has no tensor-parallel flag yet")
        worker += [flag, str(pool["tp"])]
    connector = cluster.get("connector")
    if connector is not None:
        argv += ["--connector", connector["name"]]
        if connector.get("options"):
            worker += [worker_flag(actions, "connector_options") or "--kv-connector-options",
                       json.dumps(connector["options"])]
    if worker:
        argv += ["--worker-args", shlex.join(worker)]
    return argv


def steady_env() -> dict[str, str]:
    """The clusters' environment: a sweep measures the steady state, so an engine that compiles
    does it before it reports ready (not on its background thread while the first rate runs);
    a PDCLUSTER_COMPILE_START of the user's wins."""
    env = dict(os.environ)
    env.setdefault("PDCLUSTER_COMPILE_START", "wait")
    return env


def _wait_ready(proc: subprocess.Popen[str], log: IO[str], timeout: float, what: str) -> dict[str, Any]:
    """Reads the child's stdout into the log until the READY line; keeps draining it afterwards in a
    thread, so a chatty child never blocks on a full pipe."""
    found: dict[str, Any] = {}
    ready = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            log.flush()
            if not ready.is_set() and line.startswith(READY_PREFIX):
                found.update(json.loads(line[len(READY_PREFIX):]))
                ready.set()
        ready.set()  # EOF: the child exited (or detached) without a READY line

    threading.Thread(target=pump, name=f"sweep-{what}-stdout", daemon=True).start()
    if not ready.wait(timeout):
        raise ClusterStartError(f"{what}: no {READY_PREFIX.strip()} line within {timeout:.0f} s (log: {log.name})")
    if not found:
        raise ClusterStartError(f"{what}: exited with status {proc.wait()} before it was ready (log: {log.name})")
    return found


def stop_process(proc: subprocess.Popen[str], grace_s: float = 60.0) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)  # serve's handler stops its workers by pid
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: only what it started
        proc.wait(10)


@contextlib.contextmanager
def local_cluster(entry: ClusterEntry, sweep: SweepConfig, log_path: pathlib.Path) -> Iterator[dict[str, Any]]:
    argv = CLI + serve_argv(entry)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w", encoding="utf-8") as log:
        log.write(f"$ {shlex.join(argv)}\n")
        log.flush()
        # Own session: a Ctrl-C at the terminal reaches only the sweep, which then stops the cluster
        # in order (SIGTERM, wait) instead of racing the cluster's own shutdown.
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True,
                                env=steady_env())
        try:
            yield _wait_ready(proc, log, sweep.ready_timeout_s, entry.name)
        finally:
            stop_process(proc)


def ray_config(entry: ClusterEntry, sweep: SweepConfig, namespace: str) -> dict[str, Any]:
    cluster = {**entry.cluster, "namespace": namespace,
               "router": {**entry.cluster.get("router", {}), "grpc_port": 0, "http_port": 0},
               "ready_timeout_s": sweep.ready_timeout_s}
    for key in ("num_cpus", "dashboard", "worker_host"):
        if key in sweep.ray:
            cluster[key] = sweep.ray[key]
    return cluster


def _run_cli(args: list[str], log: IO[str], timeout: float) -> int:
    log.write(f"$ {shlex.join(CLI + args)}\n")
    log.flush()
    return subprocess.run(CLI + args, stdout=log, stderr=log, timeout=timeout, check=False).returncode


@contextlib.contextmanager
def ray_cluster(entry: ClusterEntry, sweep: SweepConfig, log_path: pathlib.Path) -> Iterator[dict[str, Any]]:
    import yaml

    namespace = f"{sweep.ray.get('namespace', 'pdcluster-sweep')}-{entry.name}"
    address = sweep.ray.get("address")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w", encoding="utf-8") as log, tempfile.TemporaryDirectory(prefix="pdcluster-sweep-") as tmp:
        config_path = pathlib.Path(tmp) / f"{entry.name}.yaml"
        # Through JSON: pools sharing one engine dict would otherwise be written as YAML anchors.
        config_path.write_text(yaml.safe_dump(json.loads(json.dumps(ray_config(entry, sweep, namespace))),
                                              sort_keys=False))
        argv = CLI + ["up", "--config", str(config_path), "--detach", *(["--address", address] if address else [])]
        log.write(f"$ {shlex.join(argv)}\n{config_path.read_text()}\n")
        log.flush()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True,
                                env=steady_env())
        try:
            ready = _wait_ready(proc, log, sweep.ready_timeout_s + 120, entry.name)
            proc.wait(120)  # --detach: `up` returns once it has recorded the cluster for `down`
            yield ready
        finally:
            stop_process(proc)
            # Always: `up` may have started actors (or a local Ray head) before failing.
            if _run_cli(["down", "--namespace", namespace], log, timeout=300) != 0:
                print(f"warning: `pdcluster down --namespace {namespace}` failed; see {log_path}", file=sys.stderr)


def launch(entry: ClusterEntry, sweep: SweepConfig, launcher: str,
           log_path: pathlib.Path) -> contextlib.AbstractContextManager[Mapping[str, Any]]:
    return ray_cluster(entry, sweep, log_path) if launcher == "ray" else local_cluster(entry, sweep, log_path)
