"""Refused TLS handshakes on our gRPC servers: counted, and the peer named (issue 16, item 1).

Why this shape: gRPC core does the whole TLS handshake before any Python code of ours runs for
that connection. A plaintext peer or a certificate of another CA is refused inside core, which
only logs "Handshake failed" (no peer address); a server interceptor sees RPCs, i.e. only the
connections that passed. grpcio offers no accept hook and no way to serve an accepted socket,
so a socket-level wrapper would have to be a proxy in front of the port: a copy of every byte
of the router <-> worker hot path. What can be observed without one:

  1. gRPC core calls our certificate_configuration_fetcher (rotation.py) once per new
     connection, before its handshake: one call = one handshake started on this server (exact).
  2. The first RPC of an authenticated connection shows its peer to our interceptor
     (context.peer(), "ipv4:IP:PORT"): authenticated connections (exact, as gRPC clients
     connect for an RPC).
  3. /proc/net/tcp{,6} lists the server's connections (local port = ours): open ones, and the
     ones it closed itself (TIME_WAIT). A connection that closes without an RPC failed its
     handshake: counted as refused and named. Reading /proc costs tens of ms here, so a
     background thread does it (woken by each handshake, then every SWEEP_S while any is
     unsettled), never the handshake itself.

    pdcluster_tls_handshakes_total{server, result="started"|"authenticated"|"refused"}
    pdcluster_tls_refused_peers_total{server, peer=IP}     (64 peers at most, then "other")

Each refusal is logged with IP:PORT. A refused connection can also vanish between two reads
of the table: a client that resets it (RST: no TIME_WAIT row on either side) within the few ms
the handshake takes leaves no row. Every connection calls the fetcher once, so such a one still
shows as a start no row explains: a start older than GRACE_S that is neither pending,
authenticated nor refused is counted refused with peer="unseen". So "refused" equals
`started - authenticated` once none is in progress. Linux only (/proc); elsewhere
started/authenticated still count and nothing is reconciled.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from prometheus_client.core import CounterMetricFamily

log = logging.getLogger(__name__)
MAX_PEER_LABELS = 64
SWEEP_S = 1.0
SETTLED_KEEP_S = 180.0  # longer than TIME_WAIT (60 s): a closed row is settled once
# A start this old has had its row in the table for every read since (the accept precedes the
# fetcher call): if no read explained it, the connection came and went between two reads.
GRACE_S = 1.0
UNSEEN_PEER = "unseen"
_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
_LISTEN = "0A"

Peer = tuple[str, int]


def _hex_ip(text: str) -> str:
    raw = bytes.fromhex(text)
    # /proc prints each 32-bit word in host (little-endian) order.
    swapped = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(swapped)
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped or ip)


def server_connections(port: int, tables: tuple[str, ...] = _TABLES) -> dict[Peer, bool]:
    """(peer IP, peer port) -> open, for this host's TCP connections to local port `port`: True
    while the server holds the socket, False once closed (TIME_WAIT and other orphans). For a
    peer on this host the client's own row counts too (local = the peer, remote = our port):
    when the client closes first, only its TIME_WAIT row is left to show the connection."""
    out: dict[Peer, bool] = {}
    clients: list[Peer] = []
    for table in tables:
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) < 10 or cols[3] == _LISTEN:
                continue
            lip, _, lport = cols[1].partition(":")
            rip, _, rport = cols[2].partition(":")
            if int(lport, 16) == port:
                peer = (_hex_ip(rip), int(rport, 16))
                out[peer] = out.get(peer, False) or cols[9] != "0"
            elif int(rport, 16) == port and ipaddress.ip_address(_hex_ip(rip)).is_loopback:
                clients.append((_hex_ip(lip), int(lport, 16)))
    for peer in clients:  # evidence of a connection only; open/closed is the server side's
        out.setdefault(peer, False)
    return out


def tables_readable(tables: tuple[str, ...] = _TABLES) -> bool:
    """Whether this host shows its TCP table (Linux /proc): without it nothing is reconciled."""
    for table in tables:
        try:
            with open(table):
                return True
        except OSError:
            continue
    return False


def parse_grpc_peer(peer: str) -> Peer | None:
    """("IP", port) from gRPC's "ipv4:1.2.3.4:5" / "ipv6:[::1]:5"; None for anything else."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host, _, port = rest.rpartition(":")
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
        return str(getattr(ip, "ipv4_mapped", None) or ip), int(port)
    except ValueError:
        return None


class HandshakeAudit:
    """One TLS gRPC server's handshakes: on_handshake from its fetcher, start(port) once bound,
    interceptor() on the server, registered as a Prometheus collector; stop() with the server."""

    def __init__(self, server: str, connections: Callable[[int], dict[Peer, bool]] = server_connections) -> None:
        self.server = server
        self.port: int | None = None
        self._connections = connections
        # Reconciling starts with rows needs a real table: off where /proc/net/tcp is absent.
        self._reconcile = tables_readable()
        self._recent: deque[float] = deque()    # start times of the last GRACE_S (the rest: older)
        self._lock = threading.Lock()
        # One sweep at a time: the audit thread and each /metrics scrape both sweep. Two sweeps
        # that overlap apply their reads out of order: one that read a connection open before its
        # RPC, applied after one that saw it close and settled it, makes it pending again, and
        # the next read counts that authenticated connection as refused.
        self._sweep_lock = threading.Lock()
        self._pending: set[Peer] = set()        # open, no RPC seen yet (in or after a handshake)
        self._authed: set[Peer] = set()         # open connections that made an RPC
        self._raw: dict[str, Peer] = {}         # gRPC peer strings of those: the per-RPC fast path
        self._settled: dict[Peer, float] = {}   # closed and counted: peer -> when
        self.counts: Counter[str] = Counter()
        self.refused_peers: Counter[str] = Counter()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, port: int) -> HandshakeAudit:
        self.port = port
        self._thread = threading.Thread(target=self._run, name=f"tls-audit-{self.server}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    # -- events -----------------------------------------------------------------------------------
    def on_handshake(self) -> None:
        """gRPC core is about to run a handshake on a new connection (fetcher call): cheap."""
        with self._lock:
            self.counts["started"] += 1
            self._recent.append(time.monotonic())
        self._wake.set()

    def on_rpc(self, peer: str) -> None:
        if peer in self._raw:  # the common case (a known connection): one dict lookup, no lock
            return
        key = parse_grpc_peer(peer)
        if key is None:
            return
        with self._lock:
            self._raw[peer] = key
            if key not in self._authed:
                self._authed.add(key)
                self._pending.discard(key)
                self._settled.pop(key, None)
                self.counts["authenticated"] += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(SWEEP_S if self._pending or self._recent else None)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.sweep()
            except Exception:  # counting must not die with one bad read
                log.exception("TLS handshake audit sweep failed")

    def sweep(self) -> None:
        """Read the connection table once: new connections become pending; a connection that
        closed is settled, as refused when it never made an RPC."""
        if self.port is None:
            return
        with self._sweep_lock:
            self._sweep_once()

    def _sweep_once(self) -> None:
        assert self.port is not None
        read_at = time.monotonic()  # before the read: a start older than this - GRACE_S has a row in it
        rows = self._connections(self.port)
        now = time.monotonic()
        with self._lock:
            for peer, open_ in rows.items():
                if open_:
                    self._settled.pop(peer, None)  # a new connection on a reused port
                    if peer not in self._authed:
                        self._pending.add(peer)
                elif peer not in self._settled:
                    self._settle(peer, now)
            for peer in [p for p in self._pending if p not in rows]:
                self._settle(peer, now)  # gone without a TIME_WAIT row (the client closed first)
            for peer in [p for p in self._authed if p not in rows]:
                self._settle(peer, now)
            for peer in [p for p, t in self._settled.items() if now - t > SETTLED_KEEP_S]:
                del self._settled[peer]
            if self._reconcile:
                self._settle_unseen(read_at - GRACE_S)

    def _settle_unseen(self, cutoff: float) -> None:
        """Starts before `cutoff` that no row explained: refused, the peer unseen (under _lock).
        Each explained connection (pending, authenticated, refused) is one distinct start."""
        while self._recent and self._recent[0] <= cutoff:
            self._recent.popleft()
        old_starts = self.counts["started"] - len(self._recent)
        unseen = old_starts - self.counts["authenticated"] - self.counts["refused"] - len(self._pending)
        if unseen <= 0:
            return
        self.counts["refused"] += unseen
        self.refused_peers[UNSEEN_PEER] += unseen
        log.warning("%s: %d TLS handshake(s) refused from a peer that reset the connection before it could be "
                    "named (plaintext peer, or no certificate of this cluster's CA)", self.server, unseen)

    def _settle(self, peer: Peer, now: float) -> None:
        self._settled[peer] = now
        self._pending.discard(peer)
        if peer in self._authed:
            self._authed.discard(peer)
            self._raw = {r: p for r, p in self._raw.items() if p != peer}
            return
        self.counts["refused"] += 1
        ip = peer[0] if peer[0] in self.refused_peers or len(self.refused_peers) < MAX_PEER_LABELS else "other"
        self.refused_peers[ip] += 1
        log.warning("%s: TLS handshake from %s:%d refused (plaintext peer, or no certificate of this cluster's CA)",
                    self.server, peer[0], peer[1])

    # -- gRPC and Prometheus ----------------------------------------------------------------------
    def interceptor(self) -> grpc.aio.ServerInterceptor:
        return _AioAuditInterceptor(self)

    def sync_interceptor(self) -> grpc.ServerInterceptor:
        return _SyncAuditInterceptor(self)

    def collect(self) -> Iterator[CounterMetricFamily]:
        self.sweep()
        with self._lock:
            counts, peers = dict(self.counts), dict(self.refused_peers)
        total = CounterMetricFamily("pdcluster_tls_handshakes", "TLS handshakes on a gRPC server, by result",
                                    labels=["server", "result"])
        for result in ("started", "authenticated", "refused"):
            total.add_metric([self.server, result], float(counts.get(result, 0)))
        refused = CounterMetricFamily("pdcluster_tls_refused_peers", "Refused TLS handshakes by peer address",
                                      labels=["server", "peer"])
        for ip, n in sorted(peers.items()):
            refused.add_metric([self.server, ip], float(n))
        yield total
        yield refused


class _AioAuditInterceptor(grpc.aio.ServerInterceptor):
    """Tells the audit which connections made an RPC (the peer, from the servicer context)."""

    def __init__(self, audit: HandshakeAudit) -> None:
        self.audit = audit

    async def intercept_service(self, continuation: Callable[..., Any], handler_call_details: Any) -> Any:
        handler = await continuation(handler_call_details)
        audit = self.audit
        if handler is None:  # an unknown method still proves an authenticated connection
            async def unknown(request: Any, context: Any) -> Any:
                audit.on_rpc(context.peer())
                await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
            return grpc.unary_unary_rpc_method_handler(unknown)
        from .grpc_authz import _rebuild

        def guard(behavior: Callable[..., Any]) -> Callable[..., Any]:
            if handler.response_streaming:
                async def streaming(request: Any, context: Any) -> Any:
                    audit.on_rpc(context.peer())
                    result = behavior(request, context)
                    if hasattr(result, "__aiter__"):
                        async for item in result:
                            yield item
                    else:
                        await result
                return streaming

            async def unary(request: Any, context: Any) -> Any:
                audit.on_rpc(context.peer())
                return await behavior(request, context)
            return unary

        return _rebuild(handler, guard)


class _SyncAuditInterceptor(grpc.ServerInterceptor):
    """The same for a sync grpc.server (the kvstore master)."""

    def __init__(self, audit: HandshakeAudit) -> None:
        self.audit = audit

    def intercept_service(self, continuation: Callable[..., Any], handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        audit = self.audit
        if handler is None:  # an unknown method still proves an authenticated connection
            def unknown(request: Any, context: Any) -> Any:
                audit.on_rpc(context.peer())
                context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
            return grpc.unary_unary_rpc_method_handler(unknown)
        from .grpc_authz import _rebuild

        def guard(behavior: Callable[..., Any]) -> Callable[..., Any]:
            def noted(request: Any, context: Any) -> Any:
                audit.on_rpc(context.peer())
                return behavior(request, context)
            return noted

        return _rebuild(handler, guard)
