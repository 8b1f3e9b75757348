"""Router side of KV events: keep the PrefixIndex in step with every worker's KV cache.

    worker PUB --batches--> SUB --decode--> EventStreamTracker --apply--> PrefixIndex
                                                 |  gap / new epoch / first contact
                                                 v
    worker ROUTER <--snapshot request-- DEALER   (batches buffered meanwhile)
                  --snapshot-------------------> tracker.apply_snapshot: replace the worker's
                                                 blocks atomically, then replay the buffer

`EventStreamTracker` is pure (no sockets, no clock) and unit-tested; `KVEventSubscriber` is the
thin ZMQ shell around one tracker per worker. The wire format and the publisher live in
pdcluster.worker.kv_events_pub (workers import it; this module re-exports the types).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from pdcluster.security.curve import make_client_socket
from pdcluster.security.envelope import MalformedMessage
from pdcluster.security.keys import KeyPair
from pdcluster.worker.kv_events_pub import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    KVSnapshot,
    decode_batch,
    decode_snapshot,
    encode_snapshot_request,
)

from .prefix_index import PrefixIndex

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventStreamTracker",
    "KVEvent",
    "KVEventBatch",
    "KVEventSubscriber",
    "KVSnapshot",
    "TrackerAction",
]

log = logging.getLogger(__name__)

APPLIED, IGNORED, BUFFERED, RESYNC = "applied", "ignored", "buffered", "resync"


@dataclass(frozen=True)
class TrackerAction:
    """What the tracker did with an input. kind == "resync": the caller must request a
    snapshot from the publisher (and again if none arrives in time)."""

    kind: str  # applied | ignored | buffered | resync
    reason: str = ""

    @property
    def needs_snapshot(self) -> bool:
        return self.kind == RESYNC


class EventStreamTracker:
    """Applies one publisher's batches to the index in seq order; detects holes and restarts.

    States: `synced` (epoch known, last_seq applied) or `resyncing` (waiting for a snapshot;
    batches are buffered, at most max_buffered, oldest dropped first -- a dropped one just shows
    up as a hole after the snapshot and costs one more resync)."""

    def __init__(self, index: PrefixIndex, worker_id: str, max_buffered: int = 1024) -> None:
        self.index = index
        self.worker_id = worker_id
        self.epoch: int | None = None
        self.last_seq = 0
        self.resyncing = False
        self.num_resyncs = 0
        self._buffer: deque[KVEventBatch] = deque(maxlen=max_buffered)

    def apply(self, batch: KVEventBatch) -> TrackerAction:
        if batch.publisher_id != self.worker_id:
            return TrackerAction(IGNORED, f"batch from {batch.publisher_id!r}, expected {self.worker_id!r}")
        if self.resyncing:
            self._buffer.append(batch)
            return TrackerAction(BUFFERED, "waiting for snapshot")
        # Publishers never send empty batches, so no events = heartbeat carrying the last seq.
        heartbeat = not batch.events
        if batch.epoch != self.epoch:
            # The whole history of this epoch is still ahead only at a heartbeat of seq 0 or at
            # batch 1; anything else means we joined late or missed a restarted worker's start.
            if batch.seq > (0 if heartbeat else 1):
                reason = "first contact" if self.epoch is None else "new epoch"
                if self.epoch is not None:
                    self.index.clear_worker(self.worker_id)  # the old incarnation's blocks are gone
                return self._start_resync(batch, reason)
            self.index.clear_worker(self.worker_id)
            self.epoch, self.last_seq = batch.epoch, 0
        if batch.seq <= self.last_seq or (heartbeat and batch.seq == self.last_seq):
            return TrackerAction(IGNORED, "heartbeat" if heartbeat else "duplicate")
        if heartbeat or batch.seq != self.last_seq + 1:
            return self._start_resync(batch, f"gap: at seq {self.last_seq}, publisher is at {batch.seq}")
        self._apply_events(batch)
        self.last_seq = batch.seq
        return TrackerAction(APPLIED)

    def apply_snapshot(self, snap: KVSnapshot) -> TrackerAction:
        """Replace the worker's blocks with the snapshot, then replay buffered batches newer
        than it. Returns RESYNC if the buffer shows a hole after the snapshot or a newer epoch."""
        if snap.publisher_id != self.worker_id:
            return TrackerAction(IGNORED, f"snapshot from {snap.publisher_id!r}")
        self.index.replace_worker(self.worker_id, snap.block_hashes)
        self.epoch, self.last_seq, self.resyncing = snap.epoch, snap.seq, False
        buffered, self._buffer = list(self._buffer), deque(maxlen=self._buffer.maxlen)
        result = TrackerAction(APPLIED, "snapshot")
        for batch in buffered:
            action = self.apply(batch)
            if action.kind in (RESYNC, BUFFERED):
                result = TrackerAction(RESYNC, action.reason)
        return result

    def _start_resync(self, batch: KVEventBatch, reason: str) -> TrackerAction:
        self.resyncing = True
        self.num_resyncs += 1
        self._buffer.append(batch)
        return TrackerAction(RESYNC, reason)

    def _apply_events(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.index.add_blocks(self.worker_id, event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.index.remove_blocks(self.worker_id, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.index.clear_worker(self.worker_id)


class _Source:
    """Sockets and resync bookkeeping for one publisher."""

    def __init__(self, tracker: EventStreamTracker, sub: zmq.Socket, dealer: zmq.Socket) -> None:
        self.tracker = tracker
        self.sub = sub
        self.dealer = dealer
        self.pending_request: int | None = None  # request_id of the outstanding snapshot request
        self.requested_at = 0.0


class KVEventSubscriber:
    """Router side: SUB + snapshot DEALER per worker (CURVE clients), feeding one PrefixIndex.

    Synchronous and single-threaded: call poll() from the thread that owns the index (or run
    it in a dedicated thread that also serves the index to the policy)."""

    def __init__(
        self,
        ctx: zmq.Context,
        keypair: KeyPair,
        index: PrefixIndex,
        *,
        snapshot_timeout_s: float = 5.0,
        max_messages_per_poll: int = 1000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ctx = ctx
        self._keypair = keypair
        self.index = index
        self.snapshot_timeout_s = snapshot_timeout_s
        self.max_messages_per_poll = max_messages_per_poll
        self._clock = clock
        self._sources: dict[str, _Source] = {}
        self._request_ids = itertools.count(1)
        self.num_malformed = 0

    def add_publisher(self, worker_id: str, events_endpoint: str, snapshot_endpoint: str, server_public: bytes | str) -> None:
        if worker_id in self._sources:
            self.remove_publisher(worker_id)
        sub = make_client_socket(self._ctx, zmq.SUB, self._keypair, server_public, events_endpoint)
        sub.subscribe(b"")
        try:
            dealer = make_client_socket(self._ctx, zmq.DEALER, self._keypair, server_public, snapshot_endpoint)
        except BaseException:
            sub.close()
            raise
        self._sources[worker_id] = _Source(EventStreamTracker(self.index, worker_id), sub, dealer)

    def remove_publisher(self, worker_id: str) -> None:
        src = self._sources.pop(worker_id, None)
        if src is not None:
            src.sub.close(linger=0)
            src.dealer.close(linger=0)
        self.index.remove_worker(worker_id)

    def tracker(self, worker_id: str) -> EventStreamTracker:
        return self._sources[worker_id].tracker

    def poll(self, timeout_ms: int = 0) -> int:
        """Process what has arrived (waiting up to timeout_ms); returns batches applied."""
        poller = zmq.Poller()
        for src in self._sources.values():
            poller.register(src.sub, zmq.POLLIN)
            poller.register(src.dealer, zmq.POLLIN)
        ready = dict(poller.poll(timeout_ms)) if self._sources else {}
        applied = 0
        for worker_id, src in list(self._sources.items()):
            if src.sub in ready:
                applied += self._drain_events(worker_id, src)
            if src.dealer in ready:
                self._drain_snapshots(worker_id, src)
            if src.tracker.resyncing and (
                src.pending_request is None or self._clock() - src.requested_at > self.snapshot_timeout_s
            ):
                self._request_snapshot(worker_id, src)
        return applied

    def _drain_events(self, worker_id: str, src: _Source) -> int:
        applied = 0
        for _ in range(self.max_messages_per_poll):
            try:
                data = src.sub.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                batch = decode_batch(data)
            except MalformedMessage as e:
                # A batch we cannot read is a batch we lost: count it, and the next good one
                # reveals the hole.
                self.num_malformed += 1
                log.warning("malformed KV event batch from %s: %s", worker_id, e)
                continue
            action = src.tracker.apply(batch)
            applied += action.kind == APPLIED
            if action.kind == IGNORED and action.reason.startswith("batch from"):
                self.num_malformed += 1
                log.warning("KV events from %s: %s", worker_id, action.reason)
        return applied

    def _drain_snapshots(self, worker_id: str, src: _Source) -> None:
        for _ in range(self.max_messages_per_poll):
            try:
                data = src.dealer.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                snap = decode_snapshot(data)
            except MalformedMessage as e:
                self.num_malformed += 1
                log.warning("malformed KV snapshot from %s: %s", worker_id, e)
                continue
            if snap.request_id != src.pending_request:
                continue  # an answer to a request we already gave up on
            src.pending_request = None
            action = src.tracker.apply_snapshot(snap)
            if action.needs_snapshot:
                log.info("KV events from %s: resync again after snapshot (%s)", worker_id, action.reason)

    def _request_snapshot(self, worker_id: str, src: _Source) -> None:
        request_id = next(self._request_ids)
        try:
            src.dealer.send(encode_snapshot_request(worker_id, request_id), zmq.NOBLOCK)
        except zmq.Again:
            return  # not connected yet; retried on the next poll
        src.pending_request, src.requested_at = request_id, self._clock()

    def close(self) -> None:
        for worker_id in list(self._sources):
            src = self._sources.pop(worker_id)
            src.sub.close(linger=0)
            src.dealer.close(linger=0)
