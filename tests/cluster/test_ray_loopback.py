"""`pdcluster up` on one machine keeps every Ray listener on loopback (issue 16, item 5): the GCS,
raylet, dashboard and its agent, runtime-env agent, Ray Client server, the workers' and actors'
gRPC servers, and pdcluster's own router and workers, read from /proc for the head's whole tree."""

from __future__ import annotations

import json
import pathlib

import pytest
import ray_up
from proc_sockets import listening, non_loopback

from pdcluster.cluster.ray_head import descendants

pytestmark = pytest.mark.ray


@pytest.fixture
def cluster_env(tmp_path):
    yield from ray_up.cluster_env(tmp_path, "lb")


def test_local_up_listens_on_loopback_only(cluster_env) -> None:
    env, ns = cluster_env
    up = ray_up.cli(env, "up", "--detach", "--workers", "1", "--grpc-port", "0", "--http-port", "0", "--namespace", ns,
             "--num-cpus", "2", timeout=300)
    assert up.returncode == 0, up.stdout + up.stderr
    assert "loopback only" in up.stderr and "token authentication" in up.stderr
    state = json.loads((pathlib.Path(env["PDCLUSTER_STATE_DIR"]) / f"{ns}.json").read_text())
    assert state["ray_address"].startswith("127.0.0.1:")
    pids = [state["head_pid"], *descendants(state["head_pid"])]
    ports = listening(pids)
    # GCS, raylet, agents, router gRPC + HTTP, the worker's gRPC at least.
    assert len(ports) >= 8, ports
    assert non_loopback(pids) == []
    down = ray_up.cli(env, "down", "--namespace", ns, timeout=180)
    assert down.returncode == 0, down.stdout + down.stderr
