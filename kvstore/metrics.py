"""Prometheus export of the master's and a storage node's stats, read at scrape time (nothing to
keep in sync).

Each master and node owns its own CollectorRegistry (no process-global registry), served by
pdcluster/metrics_http.py's bounded HTTP server on 127.0.0.1 unless told otherwise. Like the workers' and the
master's endpoints it is plain HTTP without authentication (as vLLM's /metrics): what keeps it
private is the loopback bind, and serving it elsewhere is an explicit flag.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pdcluster.metrics_http import registry_of, serve_registry

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

NODE_PREFIX = PREFIX + "node_"
# StorageNode.stats() name -> (metric name without prefix, help); the rest are labelled families.
NODE_GAUGES = {
    "segments": ("segments", "segments this node holds"),
    "capacity_bytes": ("capacity_bytes", "bytes of this node's segments"),
    "open_connections": ("open_connections", "open data-plane connections"),
    "master_reachable": ("master_reachable", "1 if the last heartbeat reached the master, else 0"),
}
# What the master placed on the node, from its last heartbeat reply (absent until then, or from
# a master that predates the fields): the master allocates, so only it knows.
NODE_MASTER_GAUGES = {
    "used_bytes": ("used_bytes", "bytes the master allocated in this node's segments (objects, pending puts, "
                                 "arenas, quarantine), as of the last heartbeat"),
    "objects": ("objects", "published objects with a replica on this node, as of the last heartbeat"),
    "object_bytes": ("object_bytes", "bytes of those objects, as of the last heartbeat"),
}
NODE_COUNTERS = {
    "bytes_read": ("read_bytes", "bytes served to data-plane READs (gets over TCP)"),
    "bytes_written": ("written_bytes", "bytes received by data-plane WRITEs (puts over TCP)"),
    "requests_ok": ("requests_ok", "data-plane requests served to the end"),
    "connections_total": ("connections", "data-plane connections accepted"),
    "heartbeats": ("heartbeats", "heartbeats the master answered"),
    "heartbeat_failures": ("heartbeat_failures", "heartbeats that did not reach the master or were refused"),
    "remounts": ("remounts", "mounts again after the master answered UNKNOWN_NODE"),
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


class NodeCollector:
    """A storage node's /metrics. The node sees only its data plane: same-host clients copy
    through shared memory without it, so `requests{op}` and the byte counters are TCP traffic.
    `refused{reason}` are the data-plane callers turned away (a token whose MAC fails is
    reason="bad_mac", an expired one "expired", garbage "bad_magic", ...), the node's
    authentication refusals. used_bytes, objects and object_bytes are what the master placed
    here (whichever path wrote it), from its last heartbeat reply."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        for key, (name, doc) in NODE_GAUGES.items():
            yield GaugeMetricFamily(NODE_PREFIX + name, doc, value=s.get(key, 0))
        for key, (name, doc) in NODE_MASTER_GAUGES.items():
            if key in s:
                yield GaugeMetricFamily(NODE_PREFIX + name, doc, value=s[key])
        for key, (name, doc) in NODE_COUNTERS.items():
            yield CounterMetricFamily(NODE_PREFIX + name, doc, value=s.get(key, 0))
        ops = CounterMetricFamily(NODE_PREFIX + "requests", "data-plane requests admitted (token verified), by op",
                                  labels=["op"])
        for op in ("read", "write"):
            ops.add_metric([op], s.get(f"requests_{op}", 0))
        yield ops
        refused = CounterMetricFamily(NODE_PREFIX + "refused", "data-plane requests or connections refused, by reason",
                                      labels=["reason"])
        for key, value in sorted(s.items()):
            if key.startswith("refused_") and key != "refused_total":
                refused.add_metric([key[len("refused_"):]], value)
        yield refused


def serve_collectors(host: str, port: int, *collectors: Any) -> tuple[Any, int]:
    """Serve the collectors' /metrics on host:port (0: any free port); returns (http server,
    bound port). Stop with server.shutdown(); server.server_close()."""
    httpd, _thread = serve_registry(registry_of(*collectors), host, port)
    return httpd, httpd.server_address[1]


def serve_metrics(stats: Callable[[], dict[str, float]], host: str, port: int, *extra: Any) -> tuple[Any, int]:
    """The master's /metrics; returns (http server, bound port). Stop with server.shutdown().
    extra: more collectors (the TLS handshake audit)."""
    return serve_collectors(host, port, MasterCollector(stats), *extra)
