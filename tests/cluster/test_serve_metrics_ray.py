"""`pdcluster up --detach --workers 1` (a loopback Ray head it starts): the ready line's
instances[NAME] carries the worker's metrics URL, on loopback, and it answers after a request."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import urllib.request

import pytest

from pdcluster.cluster import ray_head

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # ~20 s; serve's metrics URLs are checked in the default suite


def cli(env: dict, *argv: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdcluster.cluster.cli", *argv], env=env, capture_output=True,
                          text=True, timeout=timeout)


def ready_payload(stdout: str) -> dict:
    line = next(x for x in stdout.splitlines() if x.startswith("PDCLUSTER_READY "))
    return json.loads(line.split(" ", 1)[1])


def read_state(env: dict, ns: str) -> dict | None:
    path = pathlib.Path(env["PDCLUSTER_STATE_DIR"]) / f"{ns}.json"
    return json.loads(path.read_text()) if path.exists() else None


@pytest.fixture
def up_env(tmp_path):
    ns = f"m{os.getpid()}"
    env = {**os.environ, "PDCLUSTER_STATE_DIR": str(tmp_path / "state")}
    env.pop("RAY_ADDRESS", None)
    yield env, ns
    state = read_state(env, ns)
    if state is not None:
        cli(env, "down", "--namespace", ns, timeout=120)
        if state.get("head_pid"):
            ray_head.stop_local_head(state["head_pid"], start_time=state.get("head_start", 0))


def test_up_ready_line_has_metrics_urls(up_env, tmp_path) -> None:
    from pdcluster.client import Client
    from pdcluster.sampling_params import SamplingParams

    env, ns = up_env
    up = cli(env, "up", "--detach", "--workers", "1", "--grpc-port", "0", "--http-port", "0", "--namespace", ns,
             "--num-cpus", "2", "--log-dir", str(tmp_path / "logs"), timeout=300)
    assert up.returncode == 0, up.stdout + up.stderr
    (inst,) = ready_payload(up.stdout)["instances"].values()
    url = inst["metrics"]
    assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
    with Client(ready_payload(up.stdout)["grpc"], timeout=60) as client:
        out = client.generate([5, 6, 7, 8], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out.token_ids) == 3
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    line = next(ln for ln in text.splitlines() if ln.startswith("pdcluster_engine_generation_tokens_total "))
    assert float(line.split()[-1]) >= 3
