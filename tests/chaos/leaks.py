"""What a chaos test checks after a fault (nothing assumed): KV blocks, running requests and leases
back to 0 on every surviving worker, no /dev/shm segment of the run's processes, no listener or
thread the run opened still there, no process of the run left; and one row of the results table
per fault x role."""

from __future__ import annotations

import os
import pathlib
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from proc_sockets import listening
from real_router_cluster import wait_until, worker_stats
from serve_procs import descendants

SHM_DIR = "/dev/shm"
# Threads made once per process and kept by design, not by the run: grpc's channel poller and the
# default executor of the test's event loop (the loop_thread fixture ends it after the rig).
_PROCESS_WIDE = ("(_poll_wrapper)", "asyncio_0", "asyncio_1")
SHM_PREFIX = "pdcluster-"  # pdcluster.transfer.region.SHM_PREFIX: segments are pdcluster-PID-...


def shm_segments(pids: list[int]) -> list[str]:
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    return sorted(n for n in names for pid in pids if n.startswith(f"{SHM_PREFIX}{pid}-"))


def scrape(url: str, name: str) -> float:
    """The sum of one metric's samples on a worker's /metrics (0 when absent)."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "))


ENDED = "pdcluster_worker_requests_ended_total"  # {reason=deadline|stream_lost}: legs ended by a failed caller


def ended_by_reason(urls: list[str | None]) -> dict[str, float]:
    """pdcluster_worker_requests_ended_total summed over these workers' /metrics, by reason."""
    out: dict[str, float] = {}
    for url in urls:
        if not url:
            continue
        for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
            if line.startswith(ENDED + "{"):
                reason = line.split('reason="', 1)[1].split('"', 1)[0]
                out[reason] = out.get(reason, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def ended_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in sorted(set(before) | set(after))}


def worker_leaks(address: str, metrics_url: str | None = None, timeout: float = 60.0,
                 stats: Callable[[str], Any] = worker_stats) -> list[str]:
    """What a worker still holds once nothing should run: [] when running, waiting, KV blocks used
    (Stats) and active P2P leases (/metrics pdcluster_connector_active_leases) are all 0, waited for:
    aborts and lease ends are asynchronous."""
    found: list[str] = []

    def clean() -> bool:
        try:
            s = stats(address)
            leases = scrape(metrics_url, "pdcluster_connector_active_leases") if metrics_url else 0
        except Exception as e:  # noqa: BLE001 - an unreachable worker is a finding, not a crash
            found[:] = [f"stats failed: {e}"]
            return False
        found[:] = [f"{k}={v:g}" for k, v in (("running", s.num_running), ("waiting", s.num_waiting),
                                               ("kv_blocks_used", s.num_kv_blocks_used), ("leases", leases)) if v]
        return not found

    wait_until(clean, timeout, 0.1)
    return found


@dataclass
class Baseline:
    """The test process's threads and listeners before the run."""

    threads: set[int] = field(default_factory=lambda: {t.ident for t in threading.enumerate()})
    listeners: set[tuple[str, int]] = field(default_factory=lambda: set(listening([os.getpid()])))

    def leftover_threads(self, timeout: float = 15.0) -> list[str]:
        def new() -> list[str]:
            return sorted(t.name for t in threading.enumerate() if t.ident not in self.threads and t.is_alive()
                          and not t.name.endswith(_PROCESS_WIDE))

        wait_until(lambda: not new(), timeout, 0.1)
        return new()

    def leftover_listeners(self) -> list[tuple[str, int]]:
        return sorted(set(listening([os.getpid()])) - self.listeners)


def leftover_processes(pids: list[int], timeout: float = 30.0) -> list[int]:
    wait_until(lambda: not [p for p in pids if _alive(p)], timeout, 0.1)
    return [p for p in pids if _alive(p)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def my_children() -> list[int]:
    return descendants(os.getpid())


@dataclass
class ResultRow:
    fault: str
    role: str
    sent: int
    right: int
    clear_error: int
    lost: int
    leaks: list[str]
    recover_s: float
    shown_by: str
    command: str = "PDCLUSTER_CHAOS_TABLE=/tmp/chaos.md .venv/bin/python -m pytest -m slow tests/chaos"

    def line(self) -> str:
        leaks = len(self.leaks) if self.leaks else 0
        detail = f" ({'; '.join(self.leaks)})" if self.leaks else ""
        return (f"| {self.fault} | {self.role} | {self.sent} | {int(self.right)} | {int(self.clear_error)} | {int(self.lost)} | "
                f"{leaks}{detail} | {self.recover_s:.1f} s | {self.shown_by} |")


def write_table(path: pathlib.Path, rows: list[ResultRow]) -> None:
    head = ["| fault | role / path | sent | right text | clear error | lost | leaks after | recover | shown by |",
            "|---|---|---|---|---|---|---|---|---|"]
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    cmds = sorted({r.command for r in rows})
    path.write_text("\n".join([*head, *(r.line() for r in rows), "", f"({stamp}; {', '.join(cmds)})", ""]))
