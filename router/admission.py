"""Admission before tokenization: a request over the in-flight cap is refused before the router
spends a tokenizer call (or a chat-template render) on it.

The orchestrator's own check at open_request stays the authority (it counts running requests);
this one also counts the requests between arrival and open_request, so a burst of long prompts
cannot queue unbounded tokenizer work behind a router that is already full.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from .errors import RouterError
from .metrics import RouterMetrics
from .orchestrator import Orchestrator


class Admission:
    def __init__(self, max_inflight: int, orchestrator: Orchestrator, metrics: RouterMetrics) -> None:
        self.max_inflight = max_inflight
        self._orch = orchestrator
        self._metrics = metrics
        self._preparing = 0

    @contextmanager
    def preparing(self, frontend: str) -> Iterator[None]:  # noqa: ARG002 - names the caller in tracebacks
        """Hold a place while the request is validated and tokenized; RESOURCE_EXHAUSTED if full."""
        if self._orch.num_inflight + self._preparing >= self.max_inflight:
            self._metrics.rejected.inc()
            err = RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"router is at its limit of {self.max_inflight} requests in flight; retry later")
            raise err  # the frontend counts it, as every refusal before open_request
        self._preparing += 1
        try:
            yield
        finally:
            self._preparing -= 1
