"""KV cache events: the wire format and the worker-side publisher.

Each worker tells the routers which KV blocks (by chained block hash) it has stored and evicted,
so prefix-aware routing can send a request where its prefix is already cached. It lives with the
worker (the engine never calls it: the worker's KVEventService drains the engine's events into
it); the router imports it only for the wire format it decodes.

Wire (msgpack envelopes, pdcluster.security.envelope; size-bounded and schema-checked):

    ZMQ PUB (CURVE server, allow-list)  --kv_event_batch-->  SUB (CURVE client) on each router
      {publisher_id, epoch, seq, ts, events: [{kind: stored|removed|cleared, block_hashes,
       parent_hash?}]}
    ZMQ ROUTER (CURVE server)  <--kv_snapshot_request {publisher_id, request_id}--  DEALER
                               --kv_snapshot {publisher_id, epoch, seq, request_id,
                                              block_hashes}-->

Ordering contract the subscriber relies on:
- `seq` counts batches per publisher and epoch: 1, 2, 3, ... with no holes. A subscriber that
  sees a hole (PUB drops messages for slow or late subscribers) asks for a snapshot.
- `epoch` identifies one incarnation of the publisher (default: start time in ns). A new epoch
  means the old blocks are gone.
- A heartbeat re-sends the current seq with no events, so a subscriber also notices a lost
  LAST batch (nothing after it would reveal the hole otherwise).
- A snapshot at seq N holds every block stored by batches <= N and not removed since (it may
  also reflect later changes: re-applying batches > N on top converges, as stores and removals
  replayed in order end in the publisher's state). Call `serve_snapshots` from the thread that
  publishes, so the block set and seq are read together.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import zmq

from pdcluster.engine.block_pool import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from pdcluster.security.curve import DEFAULT_BIND_ADDR, AllowList, CurveAuthenticator, make_server_socket
from pdcluster.security.envelope import (
    Field,
    MalformedMessage,
    MessageSchema,
    decode,
    encode,
    schema_registry,
)
from pdcluster.security.keys import KeyPair

log = logging.getLogger(__name__)

MAX_HASH_LEN = 64
MAX_EVENTS_PER_BATCH = 4096
MAX_BLOCKS_PER_EVENT = 1 << 16
MAX_HASHES_PER_BATCH = 1 << 16  # x (hash + 2 B framing) keeps a batch well under MAX_BATCH_BYTES
MAX_BATCH_BYTES = 8 << 20
MAX_SNAPSHOT_BLOCKS = 1 << 21
MAX_SNAPSHOT_BYTES = MAX_SNAPSHOT_BLOCKS * (MAX_HASH_LEN + 2) + (1 << 16)
MAX_REQUEST_BYTES = 4096
REBIND_TIMEOUT_S = 5.0
_U63 = 2**63 - 1

BlockHash = bytes

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "KVEventBatch",
    "KVEventPublisher",
    "KVSnapshot",
    "decode_batch",
    "decode_snapshot",
    "decode_snapshot_request",
    "encode_batch",
    "encode_snapshot",
    "encode_snapshot_request",
    "split_events",
]


# -- events ---------------------------------------------------------------------------------
# The event types are the block pool's own (one vocabulary from engine to router). The wire
# carries hashes only: BlockStored.token_ids / block_size stay in the worker (a hash-set index
# does not need them, and they would multiply the bytes per event by block_size).


@dataclass(frozen=True)
class KVEventBatch:
    publisher_id: str
    epoch: int
    seq: int  # 0 only in a heartbeat sent before the first batch
    events: tuple[KVEvent, ...] = ()
    ts: float = 0.0


@dataclass(frozen=True)
class KVSnapshot:
    publisher_id: str
    epoch: int
    seq: int
    block_hashes: tuple[BlockHash, ...] = field(default=(), repr=False)
    request_id: int = 0


# -- schemas ----------------------------------------------------------------------------------
_HASH = Field(bytes, bounds=(1, MAX_HASH_LEN))
_ID = Field(str, bounds=(1, 256))
_EPOCH = Field(int, bounds=(0, _U63))
_EVENT = MessageSchema(
    "kv_event",
    1,
    {
        "kind": Field(str, choices=frozenset({"stored", "removed", "cleared"})),
        "block_hashes": Field(list, required=False, bounds=(0, MAX_BLOCKS_PER_EVENT), items=_HASH, default=[]),
        "parent_hash": Field((bytes, None), required=False, bounds=(1, MAX_HASH_LEN)),
    },
)
BATCH_SCHEMA = MessageSchema(
    "kv_event_batch",
    1,
    {
        "publisher_id": _ID,
        "epoch": _EPOCH,
        "seq": Field(int, bounds=(0, _U63)),
        "ts": Field(float, required=False, default=0.0),
        "events": Field(list, bounds=(0, MAX_EVENTS_PER_BATCH), items=_EVENT),
    },
)
SNAPSHOT_REQUEST_SCHEMA = MessageSchema(
    "kv_snapshot_request", 1, {"publisher_id": _ID, "request_id": Field(int, bounds=(0, _U63))}
)
SNAPSHOT_SCHEMA = MessageSchema(
    "kv_snapshot",
    1,
    {
        "publisher_id": _ID,
        "epoch": _EPOCH,
        "seq": Field(int, bounds=(0, _U63)),
        "request_id": Field(int, bounds=(0, _U63)),
        "block_hashes": Field(list, bounds=(0, MAX_SNAPSHOT_BLOCKS), items=_HASH),
    },
)
_BATCHES = schema_registry(BATCH_SCHEMA)
_REQUESTS = schema_registry(SNAPSHOT_REQUEST_SCHEMA)
_SNAPSHOTS = schema_registry(SNAPSHOT_SCHEMA)


def _event_to_wire(event: KVEvent) -> dict:
    if isinstance(event, BlockStored):
        return {"kind": "stored", "block_hashes": list(event.block_hashes), "parent_hash": event.parent_hash}
    if isinstance(event, BlockRemoved):
        return {"kind": "removed", "block_hashes": list(event.block_hashes)}
    if isinstance(event, AllBlocksCleared):
        return {"kind": "cleared"}
    raise TypeError(f"not a KV event: {event!r}")


def _event_from_wire(d: Mapping) -> KVEvent:
    if d["kind"] == "stored":
        return BlockStored(tuple(d["block_hashes"]), d["parent_hash"])
    if d["kind"] == "removed":
        return BlockRemoved(tuple(d["block_hashes"]))
    return AllBlocksCleared()


def encode_batch(batch: KVEventBatch) -> bytes:
    body = {
        "publisher_id": batch.publisher_id,
        "epoch": batch.epoch,
        "seq": batch.seq,
        "ts": batch.ts,
        "events": [_event_to_wire(e) for e in batch.events],
    }
    return encode(BATCH_SCHEMA, body, MAX_BATCH_BYTES)


def decode_batch(data: bytes) -> KVEventBatch:
    _, b = decode(_BATCHES, data, MAX_BATCH_BYTES)
    events = tuple(_event_from_wire(e) for e in b["events"])
    return KVEventBatch(b["publisher_id"], b["epoch"], b["seq"], events, b["ts"])


def encode_snapshot(snap: KVSnapshot) -> bytes:
    body = {
        "publisher_id": snap.publisher_id,
        "epoch": snap.epoch,
        "seq": snap.seq,
        "request_id": snap.request_id,
        "block_hashes": list(snap.block_hashes),
    }
    return encode(SNAPSHOT_SCHEMA, body, MAX_SNAPSHOT_BYTES)


def decode_snapshot(data: bytes) -> KVSnapshot:
    _, b = decode(_SNAPSHOTS, data, MAX_SNAPSHOT_BYTES)
    return KVSnapshot(b["publisher_id"], b["epoch"], b["seq"], tuple(b["block_hashes"]), b["request_id"])


def encode_snapshot_request(publisher_id: str, request_id: int) -> bytes:
    return encode(SNAPSHOT_REQUEST_SCHEMA, {"publisher_id": publisher_id, "request_id": request_id})


def decode_snapshot_request(data: bytes) -> tuple[str, int]:
    _, b = decode(_REQUESTS, data, MAX_REQUEST_BYTES)
    return b["publisher_id"], b["request_id"]


def split_events(events: Sequence[KVEvent]) -> list[tuple[KVEvent, ...]]:
    """Group events into batches within the wire bounds (events per batch, hashes per batch),
    cutting oversized events into consecutive pieces (a stored piece chains on the previous
    piece's last hash, so parent_hash stays right)."""
    pieces: list[KVEvent] = []
    for event in events:
        hashes = getattr(event, "block_hashes", ())
        if len(hashes) <= MAX_HASHES_PER_BATCH:
            pieces.append(event)
            continue
        for start in range(0, len(hashes), MAX_HASHES_PER_BATCH):
            part = tuple(hashes[start : start + MAX_HASHES_PER_BATCH])
            if isinstance(event, BlockStored):
                parent = event.parent_hash if start == 0 else hashes[start - 1]
                pieces.append(BlockStored(part, parent))
            else:
                pieces.append(BlockRemoved(part))
    batches: list[tuple[KVEvent, ...]] = []
    current: list[KVEvent] = []
    num_hashes = 0
    for event in pieces:
        n = len(getattr(event, "block_hashes", ()))
        if current and (len(current) >= MAX_EVENTS_PER_BATCH or num_hashes + n > MAX_HASHES_PER_BATCH):
            batches.append(tuple(current))
            current, num_hashes = [], 0
        current.append(event)
        num_hashes += n
    if current:
        batches.append(tuple(current))
    return batches


# -- publisher --------------------------------------------------------------------------------
class KVEventPublisher:
    """Worker side: a PUB socket for event batches and a ROUTER socket for snapshot requests,
    both CURVE servers that admit only the allow-listed router keys. Single-threaded: call
    publish / heartbeat / serve_snapshots from one thread (the engine loop)."""

    def __init__(
        self,
        ctx: zmq.Context,
        auth: CurveAuthenticator,
        keypair: KeyPair,
        allowed: AllowList,
        publisher_id: str,
        snapshot_fn: Callable[[], Iterable[BlockHash]],
        *,
        epoch: int | None = None,
        events_addr: str = DEFAULT_BIND_ADDR,
        snapshot_addr: str = DEFAULT_BIND_ADDR,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.publisher_id = publisher_id
        self.epoch = time.time_ns() if epoch is None else epoch
        self.seq = 0
        self.num_malformed_requests = 0
        self.keypair = keypair
        self._snapshot_fn = snapshot_fn
        self._clock = clock
        self._auth = auth
        self.num_revoked_requests = 0
        self.num_reopens = 0  # PUB sockets replaced to end revoked subscribers' sessions
        self._ctx = ctx
        self._pub = make_server_socket(ctx, zmq.PUB, keypair, allowed, events_addr, auth=auth, name="kv_events")
        try:
            self._rep = make_server_socket(
                ctx, zmq.ROUTER, keypair, allowed, snapshot_addr, auth=auth, name="kv_snapshot"
            )
        except BaseException:
            self._pub.close()
            raise

    @property
    def server_sockets(self) -> tuple[zmq.Socket, zmq.Socket]:
        """(events PUB, snapshot ROUTER): for a KeyDirWatcher that keeps their allow-lists."""
        return self._pub, self._rep

    @property
    def events_endpoint(self) -> str:
        return self._pub.last_endpoint.decode()

    @property
    def snapshot_endpoint(self) -> str:
        return self._rep.last_endpoint.decode()

    @property
    def public_key(self) -> bytes:
        return self.keypair.public

    def publish(self, events: Sequence[KVEvent]) -> int:
        """Send events as one batch, or several when they exceed the batch bounds (nothing when
        events is empty); returns the current seq."""
        for chunk in split_events(events):
            batch = KVEventBatch(self.publisher_id, self.epoch, self.seq + 1, chunk, self._clock())
            data = encode_batch(batch)  # if this raises, seq stays put: no hole is created
            self.seq = batch.seq
            self._send(data)
        return self.seq

    def reopen_events(self, allowed: AllowList, timeout_s: float = REBIND_TIMEOUT_S) -> zmq.Socket:
        """End every live subscription and take subscribers back only through a new handshake
        against `allowed`: close the PUB socket and bind a new one on the same endpoint.

        Why: a PUB socket receives nothing from its subscribers, so session_allowed() has no
        message to drop, and libzmq cannot close one peer of a bound socket. Subscribers'
        SUB sockets reconnect by themselves; a revoked key's handshake is refused (and
        counted), the others see a seq hole for what was sent meanwhile and ask for a snapshot.
        The old listener is released by libzmq's I/O thread, so the bind is retried until the
        port is free. Returns the new socket (for the KeyDirWatcher)."""
        endpoint = self.events_endpoint
        self._pub.close(linger=0)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._pub = make_server_socket(self._ctx, zmq.PUB, self.keypair, allowed, endpoint,
                                               auth=self._auth, name="kv_events")
                break
            except zmq.ZMQError as e:
                if e.errno != zmq.EADDRINUSE:
                    raise
                if time.monotonic() >= deadline:
                    # Subscribers can no longer find us (routing loses this worker's prefix
                    # hints, nothing else): better than keeping a revoked session open.
                    log.error("KV events: %s stayed in use for %.0f s; publishing on a new port", endpoint, timeout_s)
                    host = endpoint.rsplit(":", 1)[0]
                    self._pub = make_server_socket(self._ctx, zmq.PUB, self.keypair, allowed, f"{host}:*",
                                                   auth=self._auth, name="kv_events")
                    break
                time.sleep(0.01)
        self.num_reopens += 1
        self._auth.metrics.count("kv_events", "revoked_sessions_closed")
        return self._pub

    def heartbeat(self) -> None:
        """Re-announce the current seq (no events) so subscribers detect a lost last batch."""
        self._send(encode_batch(KVEventBatch(self.publisher_id, self.epoch, self.seq, (), self._clock())))

    def _send(self, data: bytes) -> None:
        try:
            self._pub.send(data, zmq.NOBLOCK)
        except zmq.Again:
            pass  # PUB never blocks; a dropped batch is a seq hole the subscriber repairs

    def serve_snapshots(self, timeout_ms: int = 0, max_requests: int = 16) -> int:
        """Answer pending snapshot requests (waiting up to timeout_ms for the first one)."""
        served = 0
        while served < max_requests and self._rep.poll(timeout_ms if served == 0 else 0, zmq.POLLIN):
            msg = self._rep.recv_multipart(copy=False)
            if len(msg) == 2 and not self._auth.session_allowed(self._rep, msg[1]):
                # The subscriber's key was revoked after its handshake (rotation.py): not served.
                self.num_revoked_requests += 1
                self._auth.metrics.count("kv_snapshot", "session_revoked")
                continue
            frames = [f.bytes for f in msg]
            try:
                if len(frames) != 2:
                    raise MalformedMessage(f"expected 2 frames, got {len(frames)}")
                publisher_id, request_id = decode_snapshot_request(frames[1])
                if publisher_id != self.publisher_id:
                    raise MalformedMessage(f"snapshot request for {publisher_id!r}, this is {self.publisher_id!r}")
            except MalformedMessage as e:
                self.num_malformed_requests += 1
                log.warning("dropped malformed KV snapshot request: %s", e)
                continue
            snap = KVSnapshot(self.publisher_id, self.epoch, self.seq, tuple(self._snapshot_fn()), request_id)
            try:
                data = encode_snapshot(snap)
            except MalformedMessage as e:  # more blocks than one snapshot may carry
                log.error("cannot send KV snapshot: %s", e)
                continue
            self._rep.send_multipart([frames[0], data])
            served += 1
        return served

    def close(self) -> None:
        self._pub.close(linger=0)
        self._rep.close(linger=0)
