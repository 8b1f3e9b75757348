"""`pdcluster serve` and the LocalLauncher: real processes, clear failure reports, no orphans."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import openai
import pytest

from pdcluster.cluster.local_launcher import LaunchError, LocalLauncher, WorkerSpec

PY = sys.executable


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from pdcluster.models.demo import ensure_demo_model

    return str(ensure_demo_model(tmp_path_factory.mktemp("demo") / "model"))


@pytest.fixture
def spawned():
    """Processes a test started; killed by pid in the finalizer whatever happened."""
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def read_ready(proc: subprocess.Popen, timeout: float = 120.0) -> dict:
    end = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("PDCLUSTER_READY "):
            return json.loads(line.split(" ", 1)[1])
    raise AssertionError(f"no ready line; exit={proc.poll()}")


def test_serve_two_workers_then_sigterm(demo_model, spawned):
    proc = subprocess.Popen(
        [PY, "-m", "pdcluster.cluster.cli", "serve", "--model", demo_model, "--workers", "2", "--grpc-port", "0",
         "--http-port", "0", "--policy", "least_loaded", "--worker-args", "--max-model-len 512"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env={**os.environ, "PDCLUSTER_DEVICE": "cpu"})
    spawned.append(proc)
    ready = read_ready(proc)
    assert ready["grpc"].startswith("127.0.0.1:") and ready["http"].startswith("http://127.0.0.1:")
    assert len(ready["workers"]) == 2 and all(w.startswith("127.0.0.1:") for w in ready["workers"])
    pids = ready["worker_pids"]
    oa = openai.OpenAI(base_url=ready["http"] + "/v1", api_key="x", max_retries=0)
    r = oa.chat.completions.create(model=oa.models.list().data[0].id, messages=[{"role": "user", "content": "hi"}],
                                   max_tokens=3)
    assert r.usage.completion_tokens == 3
    from pdcluster.client import Client

    with Client(ready["grpc"]) as c:
        assert {w.healthy for w in c.list_workers()} == {True}
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    assert not [p for p in pids if alive(p)], "workers survived their launcher"


def test_serve_reports_workers_that_do_not_come_up(demo_model, spawned):
    proc = subprocess.Popen(
        [PY, "-m", "pdcluster.cluster.cli", "serve", "--model", demo_model, "--workers", "2", "--grpc-port", "0",
         "--http-port", "0", "--worker-args=--no-such-flag"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    spawned.append(proc)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "2 of 2 workers did not come up" in err and "both-0 (pid" in err and "exited with 2" in err
    assert "--no-such-flag" in err  # the worker's own complaint is in the report


def test_launcher_kills_a_child_that_ignores_sigterm():
    hang = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('PDCLUSTER_READY {\"address\": \"127.0.0.1:1\"}', flush=True); time.sleep(600)")
    launcher = LocalLauncher(worker_argv=[PY, "-c", hang], grace_s=0.5, echo_logs=False)
    try:
        (p,) = launcher.start([WorkerSpec("stubborn", [])])
        assert p.address == "127.0.0.1:1" and alive(p.pid)
    finally:
        t0 = time.monotonic()
        launcher.stop()
    assert p.proc.returncode == -signal.SIGKILL and time.monotonic() - t0 < 30  # grace 0.5 s, not the 600 s hang
    assert not alive(p.pid)


def test_launcher_ready_timeout_names_the_laggard():
    slow = "import time; print('loading...', flush=True); time.sleep(600)"
    ok = "import time; print('PDCLUSTER_READY {\"address\": \"h:2\"}', flush=True); time.sleep(600)"
    launcher = LocalLauncher(worker_argv=[PY, "-c"], ready_timeout_s=1.5, grace_s=2, echo_logs=False)
    with pytest.raises(LaunchError) as e:
        launcher.start([WorkerSpec("fast", [ok]), WorkerSpec("slow", [slow])])
    msg = str(e.value)
    assert "1 of 2 workers did not come up within 1.5s" in msg and "slow (pid" in msg and "loading..." in msg
    assert "fast" not in msg
    assert not [p for p in launcher.processes if alive(p.pid)]


def test_launcher_children_die_with_the_launcher(tmp_path):
    """PR_SET_PDEATHSIG: a launcher killed with SIGKILL cannot leave its workers behind."""
    script = tmp_path / "launch.py"
    script.write_text(
        "import sys, time\n"
        "from pdcluster.cluster.local_launcher import LocalLauncher, WorkerSpec\n"
        "child = \"import time; print('PDCLUSTER_READY {\\\"address\\\": \\\"h:3\\\"}', flush=True); time.sleep(600)\"\n"
        "l = LocalLauncher(worker_argv=[sys.executable, '-c', child], echo_logs=False)\n"
        "(p,) = l.start([WorkerSpec('w', [])])\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(600)\n")
    proc = subprocess.Popen([PY, str(script)], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(proc.stdout.readline())
        assert alive(child)
        proc.kill()
        proc.wait(10)
        end = time.monotonic() + 10
        while alive(child) and time.monotonic() < end:
            time.sleep(0.05)
        assert not alive(child)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if child is not None and alive(child):
            os.kill(child, signal.SIGKILL)  # the guarantee failed: still clean up
