"""`pdcluster serve` as a real process tree for tests: start it, read its ready line, stop it by pid,
and find the processes it started (from /proc)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any


def start_serve(args: list[str], timeout_s: float = 240.0) -> tuple[subprocess.Popen, dict[str, Any]]:
    """`pdcluster serve ARGS` on free ports; (process, its PDCLUSTER_READY record)."""
    cmd = [sys.executable, "-m", "pdcluster.cluster.cli", "serve", "--grpc-port", "0", "--http-port", "0", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    for line in proc.stdout:  # type: ignore[union-attr]
        if line.startswith("PDCLUSTER_READY "):
            return proc, json.loads(line.split(" ", 1)[1])
        if time.monotonic() > deadline:
            break
    stop_serve(proc)
    raise RuntimeError(f"cluster did not come up (exit {proc.poll()})")


def stop_serve(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # serve stops its children by pid
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the session serve leads: only our own tree
            proc.wait(10)


def descendants(root: int) -> list[int]:
    """Every process below root (workers run in sessions of their own, so follow parents)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])  # field 4: parent pid
        except (OSError, ValueError, IndexError):
            continue
    found, frontier = [], {root}
    while frontier:
        frontier = {pid for pid, ppid in parent.items() if ppid in frontier}
        found += sorted(frontier)
    return found
