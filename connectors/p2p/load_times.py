"""How long P2P pulls take, as histogram buckets in the connector's stats (no prometheus_client
here: the worker's collector turns the snapshot into pdcluster_connector_transfer_duration_seconds,
pdcluster/worker/metrics_collector.py). The caller serialises observe() and snapshot() (the
loader does both under its own lock)."""

from __future__ import annotations

import bisect
from typing import Any

# From a same-host memcpy of a few blocks to a slow cross-host pull of a long prompt.
LOAD_TIME_BOUNDS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class LoadTimes:
    def __init__(self, bounds: tuple[float, ...] = LOAD_TIME_BOUNDS_S) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum_s = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sum_s += seconds

    def snapshot(self) -> dict[str, Any]:
        """{"bounds": [...], "counts": [...], "sum": s}: plain data (a stats value, msgpack-safe)."""
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.sum_s}
