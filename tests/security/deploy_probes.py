"""Probes for the deployment tests (test_deployment_ports.py): hostile peers thrown at one port, a
TLS probe that tells a mutual-TLS port from the rest and checks who it lets in, the serve run's
own CA found from a worker's command line, and /metrics scrapes.

Every probe connects to 127.0.0.1 only and closes what it opens (except the half-open sockets
`hostile` returns on purpose, which the caller closes)."""

from __future__ import annotations

import os
import random
import socket
import ssl
import time
import urllib.request
from collections.abc import Callable

import grpc
import zmq
from prometheus_client.parser import text_string_to_metric_families

# The client preface of HTTP/2 plus an empty SETTINGS frame: a gRPC server answers with its own
# SETTINGS once it let our TLS client in.
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def sealed(port: int) -> bool:
    """Whether the port takes no new connection at all: a TP rank's gloo listener once its group
    is connected (distributed/seal_listeners.py drops the SYNs; loopback answers a SYN at once)."""
    s = socket.socket()
    s.settimeout(1.0)
    try:
        return s.connect_ex(("127.0.0.1", port)) != 0
    finally:
        s.close()


def closed_by_server(s: socket.socket, deadline: float) -> bool:
    """Whether the server closes `s` before `deadline` (time.monotonic()), reading and dropping
    whatever it sends first (a plaintext gRPC server sends its SETTINGS)."""
    try:
        while True:
            s.settimeout(max(0.01, deadline - time.monotonic()))
            if not s.recv(4096):
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def hostile(port: int, rng: random.Random, ctx: zmq.Context, zmq_silent: bool) -> list[socket.socket] | None:
    """Throw everything at one port; returns sockets left half-open on purpose, or None when the
    port takes no connection at all (sealed)."""
    if sealed(port):
        return None
    garbage = bytes(rng.getrandbits(8) for _ in range(4096))
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        try:
            s.sendall(garbage)
            s.recv(1024)
        except OSError:
            pass  # the peer hung up on us: fine
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        try:
            s.sendall(b"GET /../../etc/passwd HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\n\r\n")
            s.recv(1024)
        except OSError:
            pass
    z = ctx.socket(zmq.DEALER)  # a plaintext ZMQ peer: a CURVE server must never answer it
    z.setsockopt(zmq.LINGER, 0)
    # A DEALER's send blocks while it has no peer; a CURVE server that drops each failed handshake
    # can leave it with none for good (the slow suite hung here once): bounded, like every probe.
    z.setsockopt(zmq.SNDTIMEO, 2000)
    z.connect(f"tcp://127.0.0.1:{port}")
    try:
        try:
            z.send_multipart([b"", b"\x93\x01\x02\x03", garbage[:512]])
        except zmq.Again:
            pass  # never took the peer: nothing was sent, so nothing can answer
        # (A plain HTTP/gRPC port may "answer": libzmq reads its reply as a legacy ZMTP 1.0 frame.)
        assert not (z.poll(300) and zmq_silent), f"port {port} answered a plaintext ZMQ peer"
    finally:
        z.close(0)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            ch.unary_unary("/pdcluster.v1.Nope/Nope")(garbage[:100], timeout=2)
            raise AssertionError(f"port {port} served an unknown gRPC method")
        except grpc.RpcError as e:
            assert e.code() != grpc.StatusCode.OK
    half = socket.create_connection(("127.0.0.1", port), timeout=2)
    half.sendall(b"\x00\x00\x10")  # the start of a length prefix, then silence
    return [half]


def tls_probe(port: int, cert: str | None = None, key: str | None = None, timeout_s: float = 3.0) -> str:
    """"plain" (no TLS server here), "refused" (a TLS server that would not let this client in),
    "accepted" (it answered our HTTP/2 preface) or "sealed" (no connection at all: see sealed()). The server's certificate is not checked:
    this asks what the port admits, not who it is. Under TLS 1.3 a server checks the client's
    certificate after the client's side of the handshake is done, so a refusal shows as an
    alert or a close on the first read."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    if cert is not None:
        ctx.load_cert_chain(cert, key)
    if sealed(port):
        return "sealed"
    raw = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    try:
        try:
            tls = ctx.wrap_socket(raw, server_hostname="pdcluster-probe")
        except (ssl.SSLError, OSError):
            return "plain"  # not a TLS server (or one that refused before any certificate: see below)
        with tls:
            if not tls.getpeercert(binary_form=True):
                return "plain"
            try:
                tls.sendall(H2_PREFACE)
                reply = tls.recv(64)
            except (ssl.SSLError, OSError):
                reply = b""
            if not reply:
                _wait_close(tls, timeout_s)
                return "refused"
            return "accepted"
    finally:
        raw.close()


def _wait_close(tls: ssl.SSLSocket, timeout_s: float) -> None:
    """Let the server close first: its side then keeps a TIME_WAIT row, which is how its TLS
    audit tells a refused connection from one still handshaking (security/tls_audit.py)."""
    dup = socket.socket(fileno=os.dup(tls.fileno()))
    dup.settimeout(timeout_s)
    try:
        while dup.recv(4096):
            pass
    except OSError:
        pass
    finally:
        dup.close()


def serve_pki(worker_pid: int) -> str:
    """The serve run's CA folder (the root init_pki made), from a worker's --tls-ca path."""
    with open(f"/proc/{worker_pid}/cmdline", "rb") as f:
        argv = f.read().decode().split("\0")
    ca = argv[argv.index("--tls-ca") + 1]  # ROOT/tls/ca.pem
    return os.path.dirname(os.path.dirname(ca))


def scrape(url: str, context: ssl.SSLContext | None = None) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value for one /metrics page."""
    with urllib.request.urlopen(url, timeout=10, context=context) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(samples: dict, name: str, match: Callable[[dict[str, str]], bool] = lambda labels: True) -> float:
    return sum(v for (n, labels), v in samples.items() if n == name and match(dict(labels)))


def wait_for(read: Callable[[], float], at_least: float, timeout_s: float = 20.0) -> float:
    """A counter settled by a background thread (the TLS audit reads /proc, the engine swaps
    its stats after a step): poll it until it reaches at_least or the time is up."""
    deadline = time.monotonic() + timeout_s
    value = read()
    while value < at_least and time.monotonic() < deadline:
        time.sleep(0.25)
        value = read()
    return value


def wait_refusals(url: str, server: str, n: int, context: ssl.SSLContext | None = None) -> tuple[float, float, float]:
    """(refused, named 127.0.0.1, unseen) TLS handshakes of `server` on a /metrics page, polled
    until `n` refusals are settled (the audit thread settles them; 60 s bounds a hang only). A
    peer that reset its connection before the audit read the TCP table is counted as "unseen"."""
    def read() -> tuple[float, float, float]:
        s = scrape(url, context)
        mine = lambda extra: lambda labels: labels.get("server") == server and extra(labels)  # noqa: E731
        return (total(s, "pdcluster_tls_handshakes_total", mine(lambda lb: lb.get("result") == "refused")),
                total(s, "pdcluster_tls_refused_peers_total", mine(lambda lb: lb.get("peer") == "127.0.0.1")),
                total(s, "pdcluster_tls_refused_peers_total", mine(lambda lb: lb.get("peer") == "unseen")))
    wait_for(lambda: read()[0], n, timeout_s=60.0)
    return read()
