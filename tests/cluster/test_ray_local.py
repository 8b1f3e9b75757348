"""`pdcluster up --detach` on one machine (a loopback Ray head it starts), end to end through the
CLI: gRPC and HTTP requests through the router, `status`, a crashed worker restarted by Ray and
re-admitted by the router, and `down` leaving no process behind. One Ray cluster for the file."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from pdcluster.cluster import ray_head
from pdcluster.cluster.ray_head import descendants, pid_alive

pytestmark = pytest.mark.ray
PY = sys.executable


def cli(env: dict, *argv: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "pdcluster.cluster.cli", *argv], env=env, capture_output=True, text=True,
                          timeout=timeout)


def ready_payload(stdout: str) -> dict:
    line = next(x for x in stdout.splitlines() if x.startswith("PDCLUSTER_READY "))
    return json.loads(line.split(" ", 1)[1])


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def read_state(env: dict, ns: str) -> dict | None:
    path = pathlib.Path(env["PDCLUSTER_STATE_DIR"]) / f"{ns}.json"
    return json.loads(path.read_text()) if path.exists() else None


@pytest.fixture
def cluster_env(tmp_path):
    """Env of the CLI runs; the finalizer brings down whatever is still up (by its recorded pids)."""
    ns = f"t{os.getpid()}"
    env = {**os.environ, "PDCLUSTER_STATE_DIR": str(tmp_path / "state")}
    env.pop("RAY_ADDRESS", None)  # `up` starts its own local head
    yield env, ns
    state = read_state(env, ns)
    if state is not None:
        cli(env, "down", "--namespace", ns, timeout=120)
        if state.get("head_pid"):
            ray_head.stop_local_head(state["head_pid"], start_time=state.get("head_start", 0))


def generate_grpc(address: str) -> str:
    from pdcluster.client import Client
    from pdcluster.sampling_params import SamplingParams

    with Client(address, timeout=60) as client:
        return client.generate("The router sends", SamplingParams(max_tokens=4, temperature=0.0)).text


def healthy_workers(address: str) -> list:
    from pdcluster.client import Client

    try:
        with Client(address, timeout=5) as client:
            return [w for w in client.list_workers() if w.healthy]
    except Exception:
        return []


def test_up_detach_serve_restart_status_down(cluster_env) -> None:
    env, ns = cluster_env
    t0 = time.monotonic()
    log_dir = pathlib.Path(env["PDCLUSTER_STATE_DIR"]).parent / "logs"
    up = cli(env, "up", "--detach", "--workers", "1", "--grpc-port", "0", "--http-port", "0", "--namespace", ns,
             "--num-cpus", "2", "--log-dir", str(log_dir), timeout=300)
    assert up.returncode == 0, up.stdout + up.stderr
    ep = ready_payload(up.stdout)
    print(f"up --detach ready in {time.monotonic() - t0:.1f}s")
    state = read_state(env, ns)
    head_pid, head_start = state["head_pid"], state["head_start"]
    head_tree = [(p, ray_head.process_start_time(p)) for p in descendants(head_pid)]
    (inst,) = ep["instances"].values()
    first_child = inst["child_pid"]
    assert pid_alive(head_pid) and pid_alive(first_child)
    assert os.stat(env["PDCLUSTER_STATE_DIR"] + f"/{ns}.json").st_mode & 0o077 == 0
    assert "serving on" in (log_dir / "both-0.log").read_text()  # the worker's log, per instance

    # gRPC and HTTP through the router.
    assert generate_grpc(ep["grpc"])
    body = json.dumps({"model": ep["model"], "prompt": "hello", "max_tokens": 3}).encode()
    req = urllib.request.Request(ep["http"] + "/v1/completions", body, {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert json.loads(resp.read())["usage"]["completion_tokens"] == 3

    st = cli(env, "status", "--namespace", ns, "--json")
    assert st.returncode == 0, st.stderr
    (row,) = json.loads(st.stdout)["instances"]
    assert row["healthy"] and row["name"] == "both-0" and row["child_pid"] == first_child

    # The worker process crashes: its actor exits, Ray restarts it (new port), the router re-admits it.
    os.kill(first_child, signal.SIGKILL)
    restarted = wait_for(lambda: [w for w in healthy_workers(ep["grpc"]) if w.address != inst["address"]], 120,
                         "the restarted worker to be healthy at the router")
    assert len(healthy_workers(ep["grpc"])) == 1  # the dead address is gone from the registry
    assert generate_grpc(ep["grpc"])
    st = json.loads(cli(env, "status", "--namespace", ns, "--json").stdout)
    (row,) = st["instances"]
    assert row["address"] == restarted[0].address and row["restarts"] == 1
    second_child = row["child_pid"]

    down = cli(env, "down", "--namespace", ns, timeout=180)
    assert down.returncode == 0, down.stdout + down.stderr
    assert "stopped the local Ray head" in down.stdout
    gone = [first_child, second_child, head_pid]
    assert not any(pid_alive(p) for p in gone)
    left = [p for p, t in head_tree if pid_alive(p, t)]
    assert not left, f"processes of the Ray head still running: {left}"
    assert not pid_alive(head_pid, head_start)
    assert read_state(env, ns) is None
    assert state["key_dir"] and not os.path.exists(state["key_dir"])
