"""CircuitBreaker: whether the router may send traffic to one worker. Pure (no clock, no I/O).

    CLOSED --N consecutive failures, or one fatal failure--> OPEN
    OPEN   --health check answers SERVING----------------> HALF_OPEN
    HALF_OPEN --a request or a check succeeds-------------> CLOSED
    HALF_OPEN --any failure-------------------------------> OPEN

A fatal failure is a failed RPC (UNAVAILABLE, connection refused): the worker is ejected at once
instead of costing N more client requests. Failed health checks count like failed requests, so a
worker that stops answering is ejected after N check periods even when no traffic reaches it.
HALF_OPEN takes traffic: a worker that came back is useful immediately, and the first failure
sends it straight back to OPEN.
"""

from __future__ import annotations

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class CircuitBreaker:
    def __init__(self, failure_threshold: int = 3, *, start_open: bool = True) -> None:
        if failure_threshold < 1:
            raise ValueError("failure_threshold must be at least 1")
        self.failure_threshold = failure_threshold
        # A worker nobody has checked yet is not routed to: the first SERVING check admits it.
        self.state = OPEN if start_open else CLOSED
        self.consecutive_failures = 0
        self.num_ejections = 0

    @property
    def allows_traffic(self) -> bool:
        return self.state != OPEN

    def record_success(self) -> None:
        self.consecutive_failures = 0
        if self.state == HALF_OPEN:
            self.state = CLOSED

    def record_failure(self, fatal: bool = False) -> bool:
        """Count a failure; True when it ejected the worker (CLOSED/HALF_OPEN -> OPEN)."""
        self.consecutive_failures += 1
        if self.state == OPEN:
            return False
        if fatal or self.state == HALF_OPEN or self.consecutive_failures >= self.failure_threshold:
            self.state = OPEN
            self.num_ejections += 1
            return True
        return False

    def record_health(self, serving: bool) -> bool:
        """A health check result; True when it re-admitted the worker (OPEN -> HALF_OPEN)."""
        if not serving:
            self.record_failure()
            return False
        if self.state == OPEN:
            self.state = HALF_OPEN
            self.consecutive_failures = 0
            return True
        self.record_success()
        return False
