"""Per-peer caps on the HTTP frontend (issue 16, item 8): one client address cannot hold more
than max_http_connections_per_peer connections nor run more than max_http_requests_per_peer
requests at once, whatever the router's global cap leaves free.

    connection over the cap  -> "HTTP/1.1 503" (OpenAI error body, Connection: close) written on
                                the new connection before it is closed: nothing of it is parsed
    request over the cap     -> 429 RateLimitError naming the limit, Retry-After: 1
    both                     -> pdcluster_router_peer_limit_refusals{limit=connections|requests}

The peer is the client's IP address (a proxy in front makes every client one peer: set the caps
for it). /health and /metrics are not counted (probes must get through a busy peer's cap).
Connections are counted from aiohttp's web.Server hooks (connection_made/connection_lost, which
every RequestHandler calls), so a connection is refused before any request of it is read.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
from typing import Any

import grpc
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter

from .errors import RouterError

log = logging.getLogger(__name__)
_UNCOUNTED = frozenset({"/health", "/metrics"})


def _peer_of(transport: asyncio.BaseTransport | None) -> str:
    name = transport.get_extra_info("peername") if transport is not None else None
    return str(name[0]) if isinstance(name, (tuple, list)) and name else "unknown"


def _busy_response(message: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "ServiceUnavailableError", "param": None,
                                 "code": 503}}).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n").encode()
    return head + body


class PeerLimits:
    def __init__(self, max_connections: int, max_requests: int, registry: CollectorRegistry) -> None:
        self.max_connections = max_connections
        self.max_requests = max_requests
        self.refusals = Counter("pdcluster_router_peer_limit_refusals",
                                "HTTP connections/requests refused by the per-peer caps", ["limit"],
                                registry=registry)
        self._connections: collections.Counter[str] = collections.Counter()
        self._requests: collections.Counter[str] = collections.Counter()
        self._counted: dict[object, str] = {}  # handler -> peer, for connections we admitted

    # -- connections ------------------------------------------------------------------------------
    def install(self, server: web.Server) -> None:
        """Wrap the aiohttp server's connection hooks (call after AppRunner.setup())."""
        made, lost = server.connection_made, server.connection_lost

        def connection_made(handler: Any, transport: asyncio.Transport) -> None:
            peer = _peer_of(transport)
            if self._connections[peer] >= self.max_connections:
                self.refusals.labels(limit="connections").inc()
                log.warning("HTTP peer %s refused: %d connections open (max_http_connections_per_peer)",
                            peer, self._connections[peer])
                transport.write(_busy_response(
                    f"too many connections from {peer}: the limit is {self.max_connections} "
                    "(max_http_connections_per_peer)"))
                transport.close()  # flushes the 503 first; connection_lost follows
                return
            self._connections[peer] += 1
            self._counted[handler] = peer
            made(handler, transport)

        def connection_lost(handler: Any, exc: BaseException | None = None) -> None:
            peer = self._counted.pop(handler, None)
            if peer is not None:
                self._connections[peer] -= 1
                if self._connections[peer] <= 0:
                    del self._connections[peer]
            lost(handler, exc)

        server.connection_made = connection_made  # type: ignore[method-assign]
        server.connection_lost = connection_lost  # type: ignore[method-assign]

    # -- requests ---------------------------------------------------------------------------------
    def middleware(self) -> Any:
        @web.middleware
        async def per_peer_requests(request: web.Request, handler: Any) -> web.StreamResponse:
            if request.path in _UNCOUNTED:
                return await handler(request)
            peer = request.remote or "unknown"
            if self._requests[peer] >= self.max_requests:
                self.refusals.labels(limit="requests").inc()
                err = RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  f"too many requests in flight from {peer}: the limit is {self.max_requests} "
                                  "(max_http_requests_per_peer); retry later")
                return web.json_response(err.openai_body(), status=err.http_status, headers={"Retry-After": "1"})
            self._requests[peer] += 1
            try:
                return await handler(request)
            finally:
                self._requests[peer] -= 1
                if self._requests[peer] <= 0:
                    del self._requests[peer]

        return per_peer_requests

    def open_connections(self, peer: str) -> int:
        return self._connections.get(peer, 0)
