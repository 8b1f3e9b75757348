"""Prometheus export of the master's stats, read at scrape time (nothing to keep in sync).

Each master owns its own CollectorRegistry (no process-global registry), served by
prometheus_client's HTTP server on 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

PREFIX = "pdcluster_kvstore_"
GAUGES = {
    "objects": "published objects",
    "pending_puts": "puts started and not yet ended",
    "object_bytes": "bytes of published objects",
    "used_bytes": "bytes allocated in segments (objects, pending puts, quarantine)",
    "capacity_bytes": "bytes of mounted segments",
    "quarantined_bytes": "freed bytes waiting for their tokens to expire",
    "nodes": "storage nodes",
    "segments": "mounted segments",
    "hit_rate": "hits / (hits + misses) since start",
}


class MasterCollector:
    def __init__(self, stats: Callable[[], dict[str, float]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        for name, doc in GAUGES.items():
            yield GaugeMetricFamily(PREFIX + name, doc, value=s.get(name, 0))
        for name, value in sorted(s.items()):
            if name not in GAUGES:  # every other stat is a monotonic counter
                yield CounterMetricFamily(PREFIX + name, f"{name} since start", value=value)


def serve_metrics(stats: Callable[[], dict[str, float]], host: str, port: int, *extra: Any) -> tuple[Any, int]:
    """Start /metrics; returns (http server, bound port). Stop with server.shutdown().
    extra: more collectors (the TLS handshake audit)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MasterCollector(stats))
    for collector in extra:
        registry.register(collector)
    httpd, _thread = start_http_server(port, addr=host, registry=registry)
    return httpd, httpd.server_address[1]
