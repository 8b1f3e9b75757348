"""Heartbeats: a consumer renews the leases it is reading, one message per producer per period.

The period is a third of the producer's lease TTL (from its `open` reply), so two heartbeats in a
row may be lost before a lease expires under a live reader. A lost heartbeat is not an error
here: if the lease expires anyway, the reader's `done` says so and its blocks count as failed.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from .peer import ChannelPool, LoadError, Producer, call
from .wire import HEARTBEAT

log = logging.getLogger(__name__)
_MIN_PERIOD_S = 0.05
_MAX_PERIOD_S = 5.0


@dataclass
class _Entry:
    producer: Producer
    transfer_id: str
    period_s: float


class Heartbeats:
    def __init__(self, pool: ChannelPool) -> None:
        self._pool = pool
        self._lock = threading.Lock()
        self._leases: dict[str, _Entry] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="p2p-heartbeat", daemon=True)
        self._thread.start()
        self.sent = 0

    def add(self, producer: Producer, lease_id: str, transfer_id: str, ttl_ms: int) -> None:
        period = min(_MAX_PERIOD_S, max(_MIN_PERIOD_S, ttl_ms / 3000)) if ttl_ms else _MAX_PERIOD_S
        with self._lock:
            self._leases[lease_id] = _Entry(producer, transfer_id, period)
        self._wake.set()

    def remove(self, lease_id: str) -> None:
        with self._lock:
            self._leases.pop(lease_id, None)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(10.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                entries = dict(self._leases)
            period = min((e.period_s for e in entries.values()), default=_MAX_PERIOD_S)
            self._wake.wait(period)
            self._wake.clear()
            if self._stop.is_set() or not entries:
                continue
            by_producer: dict[Producer, list[dict[str, str]]] = {}
            with self._lock:  # only leases still being read
                for lease_id, e in self._leases.items():
                    by_producer.setdefault(e.producer, []).append({"lease_id": lease_id, "transfer_id": e.transfer_id})
            for producer, refs in by_producer.items():
                try:
                    call(self._pool, producer, HEARTBEAT, {"leases": refs[:1024]})
                    self.sent += 1
                except LoadError as e:
                    log.info("p2p heartbeat to %s failed: %s", producer.producer_id, e)
