"""ECControlServer: the producer's CURVE ROUTER socket and the thread that serves it.

Security (DESIGN.md section 9): CURVE with the fail-closed ZAP allow-list of pdcluster.security.curve
(plaintext, unknown-key and wrong-server-key peers never complete a handshake; the authenticator
counts each refusal); libzmq drops frames over MAXMSGSIZE before allocating them; every message is
size- and schema-checked before use (ECProducer.handle), so garbage, pickles, oversize and replayed
frames get an error reply and the thread keeps serving. The same thread runs the lease expiry scan
every EXPIRY_SCAN_S, so expiry never waits for traffic.
"""

from __future__ import annotations

import logging
import threading

import zmq

from pdcluster.security.curve import CurveAuthenticator, make_server_socket

from .options import ECOptions
from .producer import ECProducer
from .wire import MAX_FRAME_BYTES

log = logging.getLogger(__name__)
EXPIRY_SCAN_S = 0.05
SOCKET_NAME = "ec-control"


class ECControlServer:
    def __init__(self, producer: ECProducer, opts: ECOptions) -> None:
        self.producer = producer
        self._ctx = zmq.Context()
        # A context default: the listener copies socket options at bind time (inside make_server_socket).
        self._ctx.setsockopt(zmq.MAXMSGSIZE, 4 * MAX_FRAME_BYTES)
        self._auth = CurveAuthenticator(self._ctx).start()
        bind = f"tcp://{opts.host}:{opts.port or '*'}"
        try:
            self._sock = make_server_socket(self._ctx, zmq.ROUTER, opts.keypair, opts.allowed_keys, bind,
                                            auth=self._auth, name=SOCKET_NAME)
        except BaseException:
            self._auth.stop()
            self._ctx.term()
            raise
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)  # replies to a vanished peer are dropped
        bound = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)[len("tcp://"):]
        host, _, port = bound.rpartition(":")
        if opts.advertise_host:
            host = opts.advertise_host
        elif host in ("0.0.0.0", "[::]", "::"):
            self.close()
            raise ValueError("p2p_ec host is a wildcard address: set advertise_host")
        self.address = f"{host}:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ec-control", daemon=True)
        self._thread.start()

    def refusals(self) -> float:
        """CURVE handshakes this socket refused (plaintext, unknown key, bad crypto)."""
        return self._auth.metrics.value(SOCKET_NAME)

    def close(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
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
                self.producer.store.expire()
            except zmq.ZMQError as e:
                if self._stop.is_set():
                    return
                log.warning("ec control: %s", e)
            except Exception:  # never let the serving thread die: consumers would time out
                log.exception("ec control loop error")

    def _serve_one(self) -> None:
        frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
        if len(frames) < 2:
            return  # no identity: nobody to answer
        try:  # the ZAP handler's User-Id (the sender's allow-listed key name), set by libzmq
            sender = frames[1].get("User-Id")
        except zmq.ZMQError:
            sender = None
        identity, payload = frames[0].bytes, [f.bytes for f in frames[1:]]
        reply = self.producer.handle(payload, sender=sender if isinstance(sender, str) and sender else None)
        self._sock.send_multipart([identity, *reply], zmq.NOBLOCK)
