"""Counters for the worker's metrics that the scheduler's stats do not hold: tokens served and
step durations.

Each field has one writer: the token counts the event loop (AsyncEngine.generate, once per
delta), the step times the engine thread (one bisect and two adds per step, no lock, no
prometheus_client call). The metrics thread reads a snapshot at scrape time; a reader may see a
step in its bucket a moment before its duration is in the sum, never a torn number.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

# Upper bounds (seconds) of the step-time buckets; +Inf is implied. A CPU test step is ~1-50 ms,
# a large GPU batch ~10-100 ms, a step that waits on a TP rank or a transfer can take seconds.
STEP_TIME_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True)
class CountersSnapshot:
    prompt_tokens: int
    generation_tokens: int
    step_time_bounds_s: tuple[float, ...]
    step_time_counts: tuple[int, ...]  # per bucket, not cumulative; the last one is +Inf
    step_time_sum_s: float


class EngineCounters:
    def __init__(self, bounds_s: tuple[float, ...] = STEP_TIME_BUCKETS_S) -> None:
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self._bounds = bounds_s
        self._counts = [0] * (len(bounds_s) + 1)
        self._sum_s = 0.0

    def observe_step(self, seconds: float) -> None:
        # bisect_left: the first bound >= seconds, i.e. Prometheus' `value <= le`.
        self._counts[bisect_left(self._bounds, seconds)] += 1
        self._sum_s += seconds

    def snapshot(self) -> CountersSnapshot:
        return CountersSnapshot(self.prompt_tokens, self.generation_tokens, self._bounds, tuple(self._counts),
                                self._sum_s)
