"""CURVE server and client sockets with a fail-closed ZAP allow-list and refusal metrics.

    client socket (CURVE client: own key pair + server public key)
        |  CURVE handshake (encrypted; the server proves it holds the server secret key)
        v
    server socket (CURVE server, ZAP_DOMAIN = unique per socket, ZAP_ENFORCE_DOMAIN = 1)
        |  libzmq asks the ZAP handler (RFC 27) at inproc://zeromq.zap.01 of the context
        v
    CurveAuthenticator thread: allow-list per domain -> 200 (User-Id = key name) | 400
        + reads each server socket's monitor: handshake failures -> refusal counter

Why our own ZAP handler and not zmq.auth: its default lets NULL-mechanism peers in and an
empty key folder means "allow any" (CURVE_ALLOW_ANY); here anything not explicitly on a socket's
allow-list is refused, and every refusal is counted with its reason.

Fail closed: with ZAP_ENFORCE_DOMAIN set, libzmq refuses CURVE clients when no ZAP handler is
bound, so a stopped or never-started authenticator locks everyone out instead of letting
everyone in. An unknown domain or an empty allow-list is refused too.

Lifecycle (zmq contexts hang in term() while a socket is open): close server sockets, then
`auth.stop()`, then `ctx.term()`. The authenticator is a context manager.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Iterable, Mapping

import zmq
from prometheus_client import CollectorRegistry, Counter
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from pdcluster.security.keys import KeyPair, normalize_public_key

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
DEFAULT_BIND_ADDR = "tcp://127.0.0.1:*"  # loopback by default; binding elsewhere is explicit
_ZAP_VERSION = b"1.0"
_MONITOR_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_MONITOR_STOPPED
)
# Protocol error codes worth their own label; everything else is "protocol".
_PROTOCOL_REASONS = {
    zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC: "crypto",  # e.g. the client used a wrong server key
    zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: "mechanism_mismatch",  # e.g. a plaintext client
}

AllowList = Mapping[str, bytes | str] | Iterable[bytes | str]
ROTATION_SUFFIX = ".next"  # `keys rotate` names the new pair NAME.next; its User-Id stays NAME
KEY_PROPERTY = "X-Curve-Key"  # ZAP metadata: the session's Z85 key, for session_allowed()


def _zap_metadata(key: bytes) -> bytes:
    name = KEY_PROPERTY.encode()
    return bytes([len(name)]) + name + len(key).to_bytes(4, "big") + key


class HandshakeMetrics:
    """Refused CURVE handshakes, by server socket name and reason. Create one per registry and
    share it between authenticators (a registry refuses two metrics with one name).

    Reasons: key_not_allowed, no_allow_list, bad_mechanism, bad_zap_request (from the ZAP
    handler); crypto, mechanism_mismatch, protocol, no_detail (from socket monitors). ZAP
    denials are counted once, by the handler, not again from the monitor's AUTH event."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.refusals = Counter(
            "pdcluster_zmq_handshake_refusals",
            "ZMQ CURVE handshakes refused by a server socket",
            ["socket", "reason"],
            registry=registry,
        )

    def count(self, socket_name: str, reason: str) -> None:
        self.refusals.labels(socket=socket_name, reason=reason).inc()

    def value(self, socket_name: str, reason: str | None = None) -> float:
        """Refusals counted so far for one socket name (one reason, or all reasons)."""
        total = 0.0
        for metric in self.registry.collect():
            for s in metric.samples:
                if (
                    s.name == "pdcluster_zmq_handshake_refusals_total"
                    and s.labels.get("socket") == socket_name
                    and (reason is None or s.labels.get("reason") == reason)
                ):
                    total += s.value
        return total


class _Domain:
    __slots__ = ("name", "keys")

    def __init__(self, name: str, keys: dict[bytes, str]) -> None:
        self.name = name  # metric label: the logical socket name, low cardinality
        self.keys = keys  # Z85 public key -> user id (key name)


def _allow_map(allowed: AllowList) -> dict[bytes, str]:
    if isinstance(allowed, (bytes, str)):
        raise TypeError("allowed must be a {name: key} mapping or a collection of keys, not one key")
    if isinstance(allowed, Mapping):
        return {normalize_public_key(k): str(name).removesuffix(ROTATION_SUFFIX) for name, k in allowed.items()}
    out = {}
    for k in allowed:
        z = normalize_public_key(k)
        out[z] = z.decode()[:8]  # no name: the key's first characters identify the peer
    return out


class CurveAuthenticator:
    """ZAP handler + handshake-failure monitor for every CURVE server socket of one context."""

    def __init__(
        self,
        ctx: zmq.Context,
        *,
        registry: CollectorRegistry | None = None,
        metrics: HandshakeMetrics | None = None,
        poll_interval_s: float = 0.1,
    ) -> None:
        if metrics is None:
            # A private registry when the caller wants none: counts still work (tests, tools).
            metrics = HandshakeMetrics(registry if registry is not None else CollectorRegistry())
        self.metrics = metrics
        self._ctx = ctx
        # The handler thread uses plain sync sockets, also when ctx is a zmq.asyncio.Context.
        self._sync_ctx = zmq.Context.shadow(ctx.underlying)
        self._poll_ms = max(1, int(poll_interval_s * 1000))
        self._domains: dict[str, _Domain] = {}
        self._lock = threading.Lock()
        self._new_monitors: queue.SimpleQueue[tuple[zmq.Socket, str]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._zap: zmq.Socket | None = None
        self._ids = itertools.count()

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> CurveAuthenticator:
        if self._thread is not None:
            raise RuntimeError("CurveAuthenticator already started")
        zap = self._sync_ctx.socket(zmq.REP)
        zap.linger = 0
        try:
            # Bound here, not in the thread, so "another ZAP handler owns this context" is an
            # error to the caller. The socket then moves to the thread (Thread.start is a barrier).
            zap.bind(ZAP_ENDPOINT)
        except zmq.ZMQError:
            zap.close()
            raise
        self._zap = zap
        self._thread = threading.Thread(target=self._run, name="pdcluster-zap", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout_s)
        self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> CurveAuthenticator:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- allow-lists --------------------------------------------------------------------------
    def register(self, sock: zmq.Socket, name: str, allowed: AllowList) -> str:
        """Give `sock` its own ZAP domain and allow-list and watch its handshake failures.
        Must be called before the socket binds. Returns the domain."""
        domain = f"pdcluster/{name}/{next(self._ids)}"
        keys = _allow_map(allowed)
        with self._lock:
            self._domains[domain] = _Domain(name, keys)
        sock.zap_domain = domain.encode()
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        addr = f"inproc://pdcluster-monitor-{id(self):x}-{domain}"
        sock.monitor(addr, _MONITOR_EVENTS)
        mon = self._sync_ctx.socket(zmq.PAIR)
        mon.linger = 0
        mon.connect(addr)  # connected now, so no event is lost before the thread adopts it
        self._new_monitors.put((mon, domain))
        return domain

    def set_allowed(self, sock: zmq.Socket, allowed: AllowList) -> list[str]:
        """Replace a socket's allow-list (key rotation, workers joining). New handshakes see the
        new list at once; sessions of a removed key are cut by session_allowed(). Returns the
        user ids whose key was removed."""
        domain = sock.zap_domain.decode()
        keys = _allow_map(allowed)
        with self._lock:
            if domain not in self._domains:
                raise KeyError(f"socket with ZAP domain {domain!r} is not registered")
            old = self._domains[domain].keys
            self._domains[domain] = _Domain(self._domains[domain].name, keys)
        return sorted({name for k, name in old.items() if k not in keys})

    def session_allowed(self, sock: zmq.Socket, frame: zmq.Frame) -> bool:
        """Whether a message (received with copy=False) comes from a session whose key is still
        on the socket's allow-list. libzmq cannot close one peer of a bound socket, so servers
        drop what a revoked session sends; it is the honest equivalent of closing it."""
        try:
            key = frame.get(KEY_PROPERTY)
        except zmq.ZMQError:  # no metadata: not a session our handler admitted
            return False
        domain = self._domains.get(sock.zap_domain.decode())  # dict read: atomic, no lock
        return domain is not None and key.encode() in domain.keys

    # -- the handler thread -------------------------------------------------------------------
    def _run(self) -> None:
        zap = self._zap
        assert zap is not None
        poller = zmq.Poller()
        poller.register(zap, zmq.POLLIN)
        monitors: dict[zmq.Socket, str] = {}
        try:
            while not self._stop.is_set():
                while not self._new_monitors.empty():
                    mon, domain = self._new_monitors.get_nowait()
                    monitors[mon] = domain
                    poller.register(mon, zmq.POLLIN)
                for sock, _ in poller.poll(self._poll_ms):
                    if sock is zap:
                        self._handle_zap(zap)
                    elif self._handle_monitor(sock, monitors[sock]):
                        poller.unregister(sock)
                        sock.close()
                        del monitors[sock]
        except Exception:  # the thread must not die silently: that would lock everyone out
            log.exception("ZAP handler crashed; CURVE server sockets now refuse every client")
        finally:
            zap.close()
            for mon in monitors:
                mon.close()
            while not self._new_monitors.empty():
                self._new_monitors.get_nowait()[0].close()

    def _handle_zap(self, zap: zmq.Socket) -> None:
        msg = zap.recv_multipart()
        if len(msg) < 6 or msg[0] != _ZAP_VERSION:
            request_id = msg[1] if len(msg) > 1 else b""
            self.metrics.count("unknown", "bad_zap_request")
            zap.send_multipart([_ZAP_VERSION, request_id, b"400", b"malformed ZAP request", b"", b""])
            return
        _, request_id, domain_b, address, _identity, mechanism, *credentials = msg
        domain_name = domain_b.decode("utf-8", errors="replace")
        with self._lock:
            domain = self._domains.get(domain_name)
        label = domain.name if domain is not None else "unknown"
        status, text, user_id, metadata = b"400", b"", b"", b""
        if mechanism != b"CURVE" or len(credentials) != 1 or len(credentials[0]) != 32:
            reason, text = "bad_mechanism", b"only CURVE is accepted"
        elif domain is None or not domain.keys:
            reason, text = "no_allow_list", b"no allow-list for this socket"
        else:
            key = z85.encode(credentials[0])
            name = domain.keys.get(key)
            if name is None:
                reason, text = "key_not_allowed", b"client key not allowed"
            else:
                reason, status, text, user_id = "", b"200", b"OK", name.encode()
                metadata = _zap_metadata(key)
        if reason:
            self.metrics.count(label, reason)
            log.warning("refused ZMQ client %s on %s: %s", address.decode(errors="replace"), domain_name, reason)
        zap.send_multipart([_ZAP_VERSION, request_id, status, text, user_id, metadata])

    def _handle_monitor(self, mon: zmq.Socket, domain_name: str) -> bool:
        """Count one monitor event; True when the monitored socket is gone."""
        event = parse_monitor_message(mon.recv_multipart())
        kind = event["event"]
        if kind == zmq.EVENT_MONITOR_STOPPED:
            with self._lock:
                self._domains.pop(domain_name, None)
            return True
        with self._lock:
            domain = self._domains.get(domain_name)
        label = domain.name if domain is not None else "unknown"
        if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            self.metrics.count(label, _PROTOCOL_REASONS.get(event["value"], "protocol"))
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            self.metrics.count(label, "no_detail")
        return False


def make_server_socket(
    ctx: zmq.Context,
    socket_type: int,
    keypair: KeyPair,
    allowed: AllowList,
    bind_addr: str = DEFAULT_BIND_ADDR,
    *,
    auth: CurveAuthenticator,
    name: str = "server",
) -> zmq.Socket:
    """A CURVE server socket bound to bind_addr (default: loopback, random port; read the
    actual address from `sock.last_endpoint`). Only clients whose public key is in `allowed`
    (a {name: key} mapping, or keys) get in; the key name becomes the message's User-Id."""
    if keypair.secret is None:
        raise ValueError(f"server key pair {keypair.name!r} has no secret key")
    if not auth.running:
        raise RuntimeError("start the CurveAuthenticator before making server sockets")
    sock = ctx.socket(socket_type)
    try:
        sock.linger = 0
        sock.curve_secretkey = keypair.secret
        sock.curve_publickey = keypair.public
        sock.curve_server = True
        auth.register(sock, name, allowed)
        sock.bind(bind_addr)
    except BaseException:
        sock.close()
        raise
    return sock


def make_client_socket(
    ctx: zmq.Context,
    socket_type: int,
    keypair: KeyPair,
    server_public: bytes | str,
    connect_addr: str | None = None,
) -> zmq.Socket:
    """A CURVE client socket that only completes a handshake with the holder of server_public."""
    if keypair.secret is None:
        raise ValueError(f"client key pair {keypair.name!r} has no secret key")
    sock = ctx.socket(socket_type)
    try:
        sock.linger = 0
        sock.curve_secretkey = keypair.secret
        sock.curve_publickey = keypair.public
        sock.curve_serverkey = normalize_public_key(server_public)
        if connect_addr is not None:
            sock.connect(connect_addr)
    except BaseException:
        sock.close()
        raise
    return sock


def send_before(sock: zmq.Socket, data: bytes, deadline: float) -> bool:
    """Send one frame on a client socket unless `deadline` (time.monotonic()) passes first; False
    then. A DEALER whose server refused its handshake (a revoked or unknown key) has no pipe to
    send on, and a plain send() would block for ever."""
    left_ms = max(0, int((deadline - time.monotonic()) * 1000))
    if not sock.poll(left_ms, zmq.POLLOUT):
        return False
    try:
        sock.send(data, zmq.NOBLOCK)
    except zmq.Again:
        return False
    return True
