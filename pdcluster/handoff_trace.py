"""Opt-in timestamps along a disaggregated request's hand-off, for benchmarks/disagg_ttft.py.

PDCLUSTER_HANDOFF_TRACE=<file> makes every process (router, prefill and decode workers, which
inherit the environment) append one line per event, "<wall clock s> <event> <request id>", to
that file; unset, trace() is one environment lookup. Wall-clock time, because the events come
from different processes on one host. Torch-free: the router imports it.
"""

from __future__ import annotations

import os
import time


def trace(event: str, request_id: str) -> None:
    path = os.environ.get("PDCLUSTER_HANDOFF_TRACE")
    if not path:
        return
    # One small O_APPEND write per line: lines from concurrent processes do not interleave.
    line = f"{time.time():.6f} {event} {request_id}\n".encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
