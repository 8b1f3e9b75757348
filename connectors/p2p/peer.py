"""Consumer side of the side channel: who a producer is, how to reach it, and request/reply.

Trust: a producer's endpoint and public key come from the peer registry (options["peers"]) or,
for a producer not listed there, from kv_transfer_params signed with the cluster's params secret
and naming a public key on the allow-list. Nothing else in request data picks an address.

Each request/reply runs on a CURVE DEALER checked out of a pool (one user at a time), with a
deadline; a socket whose request timed out is closed, so a late reply can never answer a later
request (lazy-pirate). Handshakes are cached per producer and redone when its epoch changes.
"""

from __future__ import annotations

import hmac
import threading
import time
from dataclasses import dataclass
from typing import Any

import zmq

from pdcluster.engine.kv_connector import KVTransferParams
from pdcluster.security.curve import send_before
from pdcluster.security.envelope import MalformedMessage, MessageSchema, decode, encode
from pdcluster.security.keys import KeyMaterialError, normalize_public_key

from .options import P2POptions, check_endpoint
from .params import P2PExtra, params_signature
from .wire import (
    FINGERPRINTS,
    HS_BODIES,
    HS_REQ,
    MAX_FRAME_BYTES,
    REPLIES,
    fingerprint_mismatch,
    new_nonce,
    now_ms,
)


class LoadError(Exception):
    """A transfer cannot proceed; the message says why (logged, blocks reported failed)."""


@dataclass(frozen=True)
class Producer:
    producer_id: str
    endpoint: str
    public_key: bytes


@dataclass(frozen=True)
class Handshake:
    producer: Producer
    body: dict[str, Any]

    @property
    def epoch(self) -> int:
        return self.body["epoch"]


def resolve_producer(params: KVTransferParams, opts: P2POptions) -> Producer:
    pid = params.producer_id
    entry = opts.peers.get(pid)
    if entry is not None:
        return Producer(pid, entry.endpoint, entry.public_key)
    if opts.params_secret is None:
        raise LoadError(f"producer {pid!r} is not in the p2p peer registry (options['peers']) and no "
                        "params_secret is configured to verify signed params")
    try:
        sig = P2PExtra.of(params).signature
    except ValueError as e:
        raise LoadError(str(e)) from e
    if not sig or not hmac.compare_digest(sig, params_signature(opts.params_secret, params)):
        raise LoadError(f"kv_transfer_params of producer {pid!r} are not signed with this cluster's params_secret")
    try:
        key = normalize_public_key(params.producer_public_key)
        endpoint = check_endpoint(params.handshake_endpoint)
    except (KeyMaterialError, ValueError) as e:
        raise LoadError(f"producer {pid!r}: {e}") from e
    if key not in opts.allowed_keys.values():
        raise LoadError(f"producer {pid!r} uses a public key that is not on the allow-list")
    return Producer(pid, endpoint, key)


class ChannelPool:
    """CURVE DEALER sockets to producers, pooled per endpoint; thread-safe checkout."""

    def __init__(self, opts: P2POptions) -> None:
        self.opts = opts
        self._ctx = zmq.Context()
        self._lock = threading.Lock()
        self._idle: dict[tuple[str, bytes], list[zmq.Socket]] = {}
        self._closed = False

    def request(self, producer: Producer, payload: bytes, nonce: bytes, timeout_s: float | None = None) -> list[bytes]:
        """Send one request; the reply's frames after the echoed nonce. LoadError on timeout."""
        key = (producer.endpoint, producer.public_key)
        sock = self._checkout(key)
        deadline = time.monotonic() + (timeout_s or self.opts.request_timeout_s)
        try:
            sent = send_before(sock, payload, deadline)  # no pipe while the producer refuses our key
            while True:
                left_ms = int((deadline - time.monotonic()) * 1000)
                if not sent or left_ms <= 0 or not sock.poll(left_ms, zmq.POLLIN):
                    raise LoadError(f"producer {producer.producer_id!r} at {producer.endpoint} did not "
                                    f"{'answer' if sent else 'take the request'} "
                                    f"within {timeout_s or self.opts.request_timeout_s:.1f}s")
                frames = sock.recv_multipart()
                if frames and frames[0] == nonce:
                    break  # anything else is a stale reply to an earlier request: drop it
        except BaseException:
            sock.close(linger=0)  # its state is unknown (a late reply may still come): never reuse
            raise
        self._checkin(key, sock)
        return frames[1:]

    def _checkout(self, key: tuple[str, bytes]) -> zmq.Socket:
        with self._lock:
            if self._closed:
                raise LoadError("p2p connector is shutting down")
            idle = self._idle.get(key)
            if idle:
                return idle.pop()
        sock = self._ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.curve_secretkey = self.opts.keypair.secret
        sock.curve_publickey = self.opts.keypair.public
        sock.curve_serverkey = key[1]
        sock.setsockopt(zmq.MAXMSGSIZE, 4 * MAX_FRAME_BYTES)
        sock.connect(key[0])
        return sock

    def _checkin(self, key: tuple[str, bytes], sock: zmq.Socket) -> None:
        with self._lock:
            if not self._closed:
                self._idle.setdefault(key, []).append(sock)
                return
        sock.close(linger=0)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            socks = [s for lst in self._idle.values() for s in lst]
            self._idle.clear()
        for s in socks:
            s.close(linger=0)
        # destroy, not term: a socket still checked out by a thread that outlived its deadline
        # must not hang shutdown.
        self._ctx.destroy(linger=0)


def call(pool: ChannelPool, producer: Producer, schema: MessageSchema, fields: dict[str, Any]) -> dict[str, Any]:
    """One request; the decoded reply body (LoadError when malformed)."""
    nonce = new_nonce()
    frames = pool.request(producer, encode(schema, {"nonce": nonce, "ts_ms": now_ms(), **fields}), nonce)
    if len(frames) != 1:
        raise LoadError(f"producer {producer.producer_id!r} sent {len(frames)} reply frames, expected 1")
    try:
        return decode(REPLIES, frames[0], MAX_FRAME_BYTES)[1]
    except MalformedMessage as e:
        raise LoadError(f"producer {producer.producer_id!r} sent a malformed reply: {e}") from e


class HandshakeCache:
    """Handshakes by producer id; a new epoch (restarted producer) means a new handshake."""

    def __init__(self, pool: ChannelPool, opts: P2POptions, fingerprint: dict[str, Any]) -> None:
        self.pool, self.opts, self.fingerprint = pool, opts, fingerprint
        self._lock = threading.Lock()
        self._cache: dict[tuple[str, str], Handshake] = {}

    def get(self, producer: Producer, epoch: int, refresh: bool = False) -> Handshake:
        key = (producer.producer_id, producer.endpoint)
        with self._lock:
            hs = self._cache.get(key)
        if hs is not None and not refresh and hs.epoch == epoch and hs.producer == producer:
            return hs
        hs = self._handshake(producer)
        with self._lock:
            self._cache[key] = hs
        return hs

    def _handshake(self, producer: Producer) -> Handshake:
        nonce = new_nonce()
        msg = encode(HS_REQ, {"nonce": nonce, "ts_ms": now_ms(), "consumer_id": self.opts.engine_id,
                              "fingerprint": self.fingerprint})
        frames = self.pool.request(producer, msg, nonce)
        try:
            if len(frames) == 1:  # an error reply
                reply = decode(REPLIES, frames[0], MAX_FRAME_BYTES)[1]
                raise LoadError(f"producer {producer.producer_id!r} refused the handshake: {reply.get('error')}")
            if len(frames) != 2:
                raise LoadError(f"producer {producer.producer_id!r} sent {len(frames)} handshake frames")
            # Phase 1: the fingerprint alone; the body is decoded only if the caches are compatible
            # (a producer with another body version is refused before its body is parsed).
            _, fp = decode(FINGERPRINTS, frames[0], MAX_FRAME_BYTES)
            problem = fingerprint_mismatch(self.fingerprint, fp)
            if problem is not None:
                raise LoadError(f"producer {producer.producer_id!r}: {problem}")
            _, body = decode(HS_BODIES, frames[1], MAX_FRAME_BYTES)
        except MalformedMessage as e:
            raise LoadError(f"producer {producer.producer_id!r} sent a malformed handshake: {e}") from e
        if body["producer_id"] != producer.producer_id:
            raise LoadError(f"endpoint {producer.endpoint} is producer {body['producer_id']!r}, "
                            f"not {producer.producer_id!r}")
        return Handshake(producer, body)
