"""SideChannelServer: the producer's CURVE ROUTER socket and the thread that serves it.

Security (DESIGN.md section 9): CURVE with a fail-closed ZAP allow-list of the cluster's public
keys (plaintext, unknown-key and wrong-server-key peers never complete a handshake; refusals are
counted by the authenticator's metrics); ZMQ drops frames over MAXMSGSIZE before allocating
them; every message is size-checked and schema-checked before use (ProducerAgent.handle), so
garbage, truncated, oversize or replayed frames get an error reply and the thread keeps serving.

The same thread runs the lease expiry scan every EXPIRY_SCAN_S: expiry never waits for traffic.
"""

from __future__ import annotations

import logging
import threading

import zmq

from pdcluster.security.curve import CurveAuthenticator, make_server_socket
from pdcluster.security.rotation import KeyDirWatcher

from .agent import ProducerAgent
from .options import P2POptions
from .wire import MAX_FRAME_BYTES

log = logging.getLogger(__name__)
EXPIRY_SCAN_S = 0.05
_SOCKET_NAME = "p2p-side-channel"


class SideChannelServer:
    def __init__(self, agent: ProducerAgent, opts: P2POptions) -> None:
        self.agent = agent
        self._ctx = zmq.Context()
        # Oversize frames cost the sender its connection, not us an allocation. A context default:
        # the listener copies socket options at bind time, which happens inside make_server_socket.
        self._ctx.setsockopt(zmq.MAXMSGSIZE, 4 * MAX_FRAME_BYTES)
        self._auth = CurveAuthenticator(self._ctx).start()
        try:
            self._sock = make_server_socket(self._ctx, zmq.ROUTER, opts.keypair, opts.allowed_keys,
                                            opts.side_channel_bind, auth=self._auth, name=_SOCKET_NAME)
        except BaseException:
            self._auth.stop()
            self._ctx.term()
            raise
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)  # replies to a vanished peer are dropped
        # Rotation: the allow-list follows the key folder (keys rotate/revoke) without a restart.
        self._watcher = KeyDirWatcher(self._auth, {self._sock: opts.keys_dir}).start() if opts.keys_dir else None
        bound = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        host_port = bound[len("tcp://"):]
        host, _, port = host_port.rpartition(":")
        if opts.advertise_host:
            host = opts.advertise_host
        elif host in ("0.0.0.0", "[::]", "::"):
            raise ValueError("side_channel_bind is a wildcard address: set advertise_host")
        self.endpoint = f"tcp://{host}:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="p2p-side-channel", daemon=True)
        self._thread.start()

    def refusals(self) -> float:
        """CURVE handshakes this socket refused (plaintext, unknown key, bad crypto)."""
        return self._auth.metrics.value(_SOCKET_NAME)

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
        self._stop.set()
        self._thread.join(5.0)
        self._sock.close(linger=0)
        self._auth.stop()
        self._ctx.term()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if poller.poll(int(EXPIRY_SCAN_S * 1000)):
                    self._serve_one()
                self.agent.leases.expire()
            except zmq.ZMQError as e:
                if self._stop.is_set():
                    return
                log.warning("p2p side channel: %s", e)
            except Exception:  # never let the serving thread die: consumers would hang
                log.exception("p2p side channel loop error")

    def _serve_one(self) -> None:
        frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
        if len(frames) < 2:
            return  # no identity: nothing to answer
        if not self._auth.session_allowed(self._sock, frames[1]):
            # A session whose key was revoked since its handshake: nothing it sends is served.
            self._auth.metrics.count(_SOCKET_NAME, "session_revoked")
            return
        # The ZAP handler's User-Id: the name of the sender's allow-listed CURVE key, set by
        # libzmq on every frame of an authenticated connection (never by the peer).
        try:
            sender = frames[1].get("User-Id")
        except zmq.ZMQError:  # no User-Id on this connection: nobody to own a lease
            sender = None
        identity, payload = frames[0].bytes, [f.bytes for f in frames[1:]]
        reply = self.agent.handle(payload, sender=sender if isinstance(sender, str) and sender else None)
        self._sock.send_multipart([identity, *reply], zmq.NOBLOCK)
