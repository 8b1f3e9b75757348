"""Start `pdcluster serve-worker` (or another serving subcommand) as a real subprocess and wait
for its readiness line.

Always pair start_worker() with WorkerProcess.stop() (fixtures do it in a finalizer): it stops
exactly the process it started, by pid, SIGTERM first, SIGKILL if it does not exit in time.
"""

from __future__ import annotations

import json
import os
import pathlib
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

READY_PREFIX = "PDCLUSTER_READY "
HELD_CLI = pathlib.Path(__file__).resolve().parent.parent / "held_cli.py"


@dataclass
class WorkerProcess:
    proc: subprocess.Popen
    ready: dict
    stderr_path: pathlib.Path
    stdout_lines: list[str] = field(default_factory=list)

    @property
    def address(self) -> str:
        return self.ready["address"]

    def stderr_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.stderr_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def start_worker(args: Sequence[str], log_dir: pathlib.Path, *, env: dict[str, str] | None = None,
                 timeout: float = 180.0, hold: bool = False) -> WorkerProcess:
    """hold: requests with ids starting with engine_hold.HOLD_PREFIX are held after their first outputs."""
    return start_cli(["serve-worker", *args], log_dir, env=env, timeout=timeout, hold=hold)


def start_cli(args: Sequence[str], log_dir: pathlib.Path, *, env: dict[str, str] | None = None,
              timeout: float = 180.0, hold: bool = False) -> WorkerProcess:
    """`pdcluster ARGS...` (serve-worker, router, ...) until its PDCLUSTER_READY line."""
    log_dir.mkdir(parents=True, exist_ok=True)
    stderr_path = log_dir / f"{args[0]}-{time.monotonic_ns()}.stderr"
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env.setdefault("PDCLUSTER_DEVICE", "cpu")
    with open(stderr_path, "wb") as err:
        cli = [str(HELD_CLI)] if hold else ["-m", "pdcluster.cluster.cli"]
        proc = subprocess.Popen([sys.executable, *cli, *args],
                                stdout=subprocess.PIPE, stderr=err, env=full_env, text=True)
    lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()

    def read() -> None:  # a thread, so waiting for the line can time out
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    wp = WorkerProcess(proc, {}, stderr_path)
    end = time.monotonic() + timeout
    try:
        while time.monotonic() < end:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(f"{args[0]} exited with {proc.wait(5)} before ready:\n{wp.stderr_tail()}")
            wp.stdout_lines.append(line)
            if line.startswith(READY_PREFIX):
                wp.ready = json.loads(line[len(READY_PREFIX):])
                return wp
        raise TimeoutError(f"{args[0]} not ready in {timeout}s:\n{wp.stderr_tail()}")
    except BaseException:
        wp.stop(5)
        raise
