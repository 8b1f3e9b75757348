"""Real kvstore processes on 127.0.0.1 for the integration tests; every one is stopped by pid."""

from __future__ import annotations

import glob
import json
import os
import queue
import secrets
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from pdcluster.transfer.region import shm_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Procs:
    tmp: str
    secret_file: str
    started: list[subprocess.Popen] = field(default_factory=list)

    def spawn(self, module: str, *args: str, timeout: float = 30.0) -> tuple[subprocess.Popen, dict]:
        log = open(os.path.join(self.tmp, f"{module.rsplit('.', 1)[-1]}-{len(self.started)}.log"), "wb")
        proc = subprocess.Popen([sys.executable, "-m", module, "--secret-file", self.secret_file, *args],
                                stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, text=True)
        self.started.append(proc)
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
        try:
            ready = json.loads(lines.get(timeout=timeout))
        except queue.Empty:
            raise RuntimeError(f"{module} did not get ready; see {log.name}") from None
        return proc, ready

    def master(self, *args: str) -> tuple[subprocess.Popen, str]:
        proc, ready = self.spawn("pdcluster.kvstore.master", "--node-timeout-s", "3", "--grace-s", "0.5", *args)
        return proc, ready["address"]

    def node(self, master: str, node_id: str, size: str = "8M", *args: str) -> subprocess.Popen:
        return self.spawn("pdcluster.kvstore.node", "--master", master, "--node-id", node_id, "--size", size,
                          "--heartbeat-s", "0.3", *args)[0]

    @staticmethod
    def free_port() -> int:
        return free_port()

    @staticmethod
    def kill(proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def stop_all(self) -> None:
        for proc in reversed(self.started):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait(10)
            # A SIGKILLed owner cannot unlink its segments: clean up after our own children only.
            for path in glob.glob(os.path.join(shm_dir(), f"pdcluster-{proc.pid}-*")):
                os.unlink(path)


def _procs(tmp: str) -> Procs:
    secret_file = os.path.join(tmp, "kv.secret")
    fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return Procs(tmp, secret_file)


@pytest.fixture
def procs(tmp_path) -> Iterator[Procs]:
    p = _procs(str(tmp_path))
    try:
        yield p
    finally:
        p.stop_all()


@dataclass
class Cluster:
    procs: Procs
    master_addr: str
    metrics_port: int


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    """One master (with /metrics) and two storage nodes, shared by a module's tests."""
    p = _procs(str(tmp_path_factory.mktemp("kvcluster")))
    try:
        _, ready = p.spawn("pdcluster.kvstore.master", "--port", "0", "--metrics-port", "0",
                           "--data-dir", os.path.join(p.tmp, "master"))
        for i in range(2):
            p.node(ready["address"], f"node{i}")
        yield Cluster(p, ready["address"], ready["metrics_port"])
    finally:
        p.stop_all()
