"""Process helpers of the TP tests (by pid, /proc based; never by name)."""

from __future__ import annotations

import os
import time


def alive(pid: int) -> bool:
    """True while pid runs (a zombie counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def children_of(pid: int) -> list[int]:
    """Live child pids of pid (scan of /proc, so it works without CONFIG_PROC_CHILDREN)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(") ", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(entry))
    return out


def wait_dead(pids: list[int], timeout: float = 15.0) -> list[int]:
    """Wait until every pid exited; returns those still alive at the timeout."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p in pids if alive(p)]
