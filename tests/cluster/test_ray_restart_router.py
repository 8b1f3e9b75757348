"""The router actor of `pdcluster up --detach` is restarted by Ray like the workers: SIGKILL its
process (pid from `status --json`), and requests work again through the SAME address once the new
incarnation has re-read the workers' addresses and bound the recorded ports."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from pdcluster.cluster import ray_head

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def cli(env: dict, *argv: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdcluster.cluster.cli", *argv], env=env, capture_output=True,
                          text=True, timeout=timeout)


def ready_payload(stdout: str) -> dict:
    line = next(x for x in stdout.splitlines() if x.startswith("PDCLUSTER_READY "))
    return json.loads(line.split(" ", 1)[1])


@pytest.fixture
def cluster_env(tmp_path):
    """Env of the CLI runs; the finalizer brings down whatever is still up (by its recorded pids)."""
    ns = f"r{os.getpid()}"
    env = {**os.environ, "PDCLUSTER_STATE_DIR": str(tmp_path / "state")}
    env.pop("RAY_ADDRESS", None)  # `up` starts its own local head
    yield env, ns
    path = pathlib.Path(env["PDCLUSTER_STATE_DIR"]) / f"{ns}.json"
    if path.exists():
        state = json.loads(path.read_text())
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

    with Client(address, timeout=5) as client:
        return [w for w in client.list_workers() if w.healthy]


def status(env: dict, ns: str) -> dict:
    st = cli(env, "status", "--namespace", ns, "--json")
    assert st.returncode == 0, st.stdout + st.stderr
    return json.loads(st.stdout)


def poll(fn, timeout_s: float, what: str):
    """fn() until it returns a truthy value without raising; generous bounds, no speed assumed."""
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            value = fn()
            if value:
                return value
        except Exception as e:  # the router is restarting: connection refused, UNAVAILABLE
            last = e
        time.sleep(1.0)
    raise AssertionError(f"timed out waiting for {what} (last error: {last!r})")


def test_router_restarted_on_same_address(cluster_env) -> None:
    env, ns = cluster_env
    up = cli(env, "up", "--detach", "--workers", "1", "--grpc-port", "0", "--http-port", "0", "--namespace", ns,
             "--num-cpus", "2", timeout=300)
    assert up.returncode == 0, up.stdout + up.stderr
    ep = ready_payload(up.stdout)
    assert generate_grpc(ep["grpc"])
    router = status(env, ns)["router"]
    assert router["grpc"] == ep["grpc"]
    first_pid = router["actor_pid"]

    os.kill(first_pid, signal.SIGKILL)
    # Nothing but clients on the old address: the new incarnation resumes by itself.
    try:
        poll(lambda: healthy_workers(ep["grpc"]), 240, "the worker healthy at the restarted router (same address)")
    except AssertionError as e:
        raise AssertionError(f"{e}; status: {status(env, ns)}") from None
    assert generate_grpc(ep["grpc"])  # same client-facing address as before the kill
    router = status(env, ns)["router"]
    assert router["actor_pid"] != first_pid and router["serving"], router
    assert router["grpc"] == ep["grpc"] and router["http"] == ep["http"]
    assert router["resume"]["resumed"] and router["resume"]["same_ports"], router["resume"]
    assert router.get("restarts", 1) >= 1
    (row,) = status(env, ns)["instances"]
    assert row["healthy"]
