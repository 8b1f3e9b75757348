"""Prometheus /metrics over plain HTTP with bounded connections (the workers' and the kvstore's
endpoints; the router serves its /metrics on its aiohttp frontend, under its peer limits).

    httpd, thread = serve_registry(registry_of(collector, ...), host="127.0.0.1", port=0)
    httpd.server_port, httpd.refused     # bound port; connections turned away at the cap
    httpd.shutdown(); httpd.server_close()

prometheus_client's own `start_http_server` starts a thread per connection and reads the request
with no timeout, so every idle or half-sent connection held a thread for ever: a few hundred of
them and the endpoint stopped accepting, and each one cost the serving process a thread. Here at
most `max_connections` are served at once (more are closed at once and counted: a scraper retries),
and a connection that sends nothing for `idle_timeout_s` is closed. Imports no torch.
"""

from __future__ import annotations

import logging
import socket
import threading
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app

log = logging.getLogger(__name__)

DEFAULT_MAX_CONNECTIONS = 16  # a scrape is one short request; a few scrapers at once are plenty
DEFAULT_IDLE_TIMEOUT_S = 10.0


class _Handler(WSGIRequestHandler):
    def setup(self) -> None:
        self.timeout = self.server.idle_timeout_s  # type: ignore[attr-defined]  # StreamRequestHandler applies it
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002  # scrapes are not logged
        pass


class BoundedMetricsServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], family: socket.AddressFamily, max_connections: int,
                 idle_timeout_s: float) -> None:
        if max_connections < 1 or idle_timeout_s <= 0:
            raise ValueError("max_connections must be >= 1 and idle_timeout_s > 0")
        self.address_family = family
        self.idle_timeout_s = idle_timeout_s
        self.refused = 0
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # starts the connection's thread
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A peer that timed out, reset or sent garbage: its connection is closed; nothing to print.
        log.debug("metrics connection from %s ended with an error", client_address, exc_info=True)


def registry_of(*collectors: Any) -> CollectorRegistry:
    """A registry of its own (never prometheus_client's global one) holding `collectors`."""
    registry = CollectorRegistry(auto_describe=False)
    for collector in collectors:
        registry.register(collector)
    return registry


def serve_registry(registry: CollectorRegistry, host: str, port: int,
                   max_connections: int = DEFAULT_MAX_CONNECTIONS,
                   idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S) -> tuple[BoundedMetricsServer, threading.Thread]:
    """Serve `registry` on host:port (0: a free port) from a daemon thread."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, sockaddr = infos[0]
    httpd = BoundedMetricsServer((str(sockaddr[0]), port), family, max_connections, idle_timeout_s)
    httpd.set_app(make_wsgi_app(registry))
    thread = threading.Thread(target=httpd.serve_forever, name="pdcluster-metrics", daemon=True)
    thread.start()
    return httpd, thread
