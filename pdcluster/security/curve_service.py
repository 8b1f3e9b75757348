"""CurveRouterService: a CURVE-authenticated ZMQ ROUTER endpoint and the one thread that serves it.

The control planes of the connectors (the P2P KV side channel, the p2p_ec encoder-cache control
port) are the same server with another message handler, so the security-relevant part lives here
once (DESIGN.md section 9):

- CURVE with the fail-closed ZAP allow-list of pdcluster.security.curve: plaintext, unknown-key and
  wrong-server-key peers never complete a handshake; the authenticator counts each refusal.
- libzmq drops frames over MAXMSGSIZE (4 x the handler's frame bound) before allocating them; the
  handler size- and schema-checks every message, so garbage, pickles, oversize or replayed frames
  get an error reply and the thread keeps serving.
- Rotation: with a key folder the allow-list follows it (KeyDirWatcher), and whatever a revoked
  key's live session still sends is dropped (`session_revoked`), since libzmq cannot close one
  peer of a bound socket.
- The sender a handler sees is the ZAP User-Id (the name of the sender's allow-listed key), set by
  libzmq on every frame of an authenticated connection, never by the peer.
- `tick()` runs on the same thread every TICK_S (lease expiry scans), so it never waits for traffic.

Subclasses set what handle() needs, then call super().__init__(), which starts the thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

import zmq

from pdcluster.security.curve import CurveAuthenticator, make_server_socket
from pdcluster.security.keys import KeyPair
from pdcluster.security.rotation import KeyDirWatcher

log = logging.getLogger(__name__)
WILDCARDS = ("0.0.0.0", "[::]", "::")


class CurveRouterService:
    TICK_S = 0.05

    def __init__(self, *, name: str, keypair: KeyPair, allowed_keys: Mapping[str, bytes], bind: str,
                 max_frame_bytes: int, keys_dir: str | None = None, advertise_host: str | None = None,
                 wildcard_error: str = "the bind address is a wildcard: set advertise_host") -> None:
        self.name = name
        self._ctx = zmq.Context()
        # A context default: the listener copies socket options at bind time (in make_server_socket).
        self._ctx.setsockopt(zmq.MAXMSGSIZE, 4 * max_frame_bytes)
        self.auth = CurveAuthenticator(self._ctx).start()
        self._watcher: KeyDirWatcher | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        try:
            self.sock = make_server_socket(self._ctx, zmq.ROUTER, keypair, dict(allowed_keys), bind,
                                           auth=self.auth, name=name)
        except BaseException:
            self.auth.stop()
            self._ctx.term()
            raise
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)  # replies to a vanished peer are dropped
        if keys_dir:
            self._watcher = KeyDirWatcher(self.auth, {self.sock: keys_dir}).start()
        host, _, port = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)[len("tcp://"):].rpartition(":")
        if advertise_host:
            host = advertise_host
        elif host in WILDCARDS:
            self.close()
            raise ValueError(wildcard_error)
        self.address = f"{host}:{port}"
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- what a subclass provides -----------------------------------------------------------------
    def handle(self, frames: list[bytes], sender: str | None) -> list[bytes]:
        """Reply frames for one request's frames (after the ROUTER identity). Must not raise."""
        raise NotImplementedError

    def tick(self) -> None:
        """Periodic work on the serving thread (every TICK_S)."""

    # -- the service ------------------------------------------------------------------------------
    def refusals(self) -> float:
        """CURVE handshakes this socket refused (plaintext, unknown key, bad crypto)."""
        return self.auth.metrics.value(self.name)

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        self.sock.close(linger=0)
        self.auth.stop()
        self._ctx.term()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if poller.poll(int(self.TICK_S * 1000)):
                    self._serve_one()
                self.tick()
            except zmq.ZMQError as e:
                if self._stop.is_set():
                    return
                log.warning("%s: %s", self.name, e)
            except Exception:  # never let the serving thread die: its peers would time out
                log.exception("%s loop error", self.name)

    def _serve_one(self) -> None:
        frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
        if len(frames) < 2:
            return  # no identity: nobody to answer
        if not self.auth.session_allowed(self.sock, frames[1]):
            self.auth.metrics.count(self.name, "session_revoked")  # its key was revoked since the handshake
            return
        try:
            sender = frames[1].get("User-Id")
        except zmq.ZMQError:  # no User-Id on this connection: nobody to own a lease
            sender = None
        identity, payload = frames[0].bytes, [f.bytes for f in frames[1:]]
        reply = self.handle(payload, sender if isinstance(sender, str) and sender else None)
        self.sock.send_multipart([identity, *reply], zmq.NOBLOCK)


__all__ = ["CurveRouterService"]
