"""The worker's Prometheus endpoint: a registry of its own (never prometheus_client's global one,
so tests and several workers in one process do not collide) served over HTTP by
a bounded WSGI server (pdcluster/metrics_http.py) in a daemon thread, apart from the gRPC event loop.

    metrics = start_metrics_server(WorkerCollector(...), host="127.0.0.1", port=0)
    metrics.url      # http://127.0.0.1:PORT/metrics, in the worker's PDCLUSTER_READY line
    metrics.stop()

Loopback by default (DESIGN.md 9): serving it elsewhere is an explicit --metrics-host. A scrape
runs the collector on the server's thread; the collector reads snapshots only, so a scrape never
waits on the engine. Imports prometheus_client and nothing heavier (no torch).
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from pdcluster.metrics_http import registry_of, serve_registry

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from pdcluster.metrics_http import BoundedMetricsServer

log = logging.getLogger(__name__)

DEFAULT_METRICS_HOST = "127.0.0.1"
METRICS_PATH = "/metrics"


class MetricsServer:
    def __init__(self, registry: CollectorRegistry, httpd: BoundedMetricsServer, thread: threading.Thread, url: str) -> None:
        self.registry = registry
        self.url = url
        self._httpd = httpd
        self._thread = thread

    @property
    def port(self) -> int:
        return int(self._httpd.server_port)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving and close the listening socket. Idempotent."""
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._thread.join(timeout_s)
        self._httpd.server_close()


def start_metrics_server(*collectors: Collector, host: str = DEFAULT_METRICS_HOST, port: int = 0,
                         advertise_host: str | None = None) -> MetricsServer:
    """Serve the collectors on host:port (0: a free port); the URL names advertise_host, else
    host (a wildcard bind is not dialable: then this machine's name)."""
    registry = registry_of(*collectors)
    try:
        httpd, thread = serve_registry(registry, host, port)
    except OSError as e:
        raise OSError(f"could not bind the metrics endpoint to {host}:{port} (--metrics-host/--metrics-port): {e}") from e
    bound = int(httpd.server_port)
    shown = advertise_host or (socket.gethostname() if host in ("0.0.0.0", "::", "") else host)
    shown = f"[{shown}]" if ":" in shown and not shown.startswith("[") else shown
    url = f"http://{shown}:{bound}{METRICS_PATH}"
    log.info("metrics on %s", url)
    return MetricsServer(registry, httpd, thread, url)
