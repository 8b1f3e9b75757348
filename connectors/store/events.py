"""StoredBlockTracker: the store connector's KV events, aggregated over every shard.

Each TP rank writes only its own shards, and puts can fail (no space, a node lost), so "a rank
finished its save" does not mean "the block is in the store". The tracker asks the store itself:

    expect(hashes)    the scheduler side scheduled saves of these blocks
    poll thread       every poll_s: one batch_exists over every shard of every expected block;
                      a block whose S shards all exist -> BlockStored; one still incomplete after
                      timeout_s is dropped (its save failed somewhere: no event, never a false one)
    saw_missing(h)    a lookup found a block we reported incomplete (evicted) -> BlockRemoved
    take()            drain the events (Scheduler.take_kv_events)
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

from pdcluster.engine.block_pool import BlockRemoved, BlockStored, KVEvent

from .backend import StoreBackend, StoreBackendError
from .layout import StoreLayout

log = logging.getLogger(__name__)
MAX_TRACKED = 1 << 16  # bounded memory: beyond it the oldest hashes are forgotten (under-reporting)
MAX_KEYS_PER_POLL = 4096


class StoredBlockTracker:
    def __init__(self, backend: StoreBackend, layout: StoreLayout, poll_s: float = 0.05,
                 timeout_s: float = 60.0) -> None:
        self._backend = backend
        self._layout = layout
        self._poll_s = max(poll_s, 0.001)
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._pending: OrderedDict[bytes, tuple[bytes | None, float]] = OrderedDict()  # hash -> (parent, deadline)
        self._reported: OrderedDict[bytes, None] = OrderedDict()
        self._events: list[KVEvent] = []
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="store-events", daemon=True)
        self._thread.start()

    def expect(self, hashes: Sequence[bytes], parent: bytes | None) -> None:
        """Saves of consecutive blocks of one request were scheduled; parent chains the first."""
        deadline = time.monotonic() + self._timeout_s
        with self._lock:
            for h in hashes:
                if h not in self._reported:
                    self._pending[h] = (parent, deadline)
                    while len(self._pending) > MAX_TRACKED:
                        self._pending.popitem(last=False)
                parent = h
        self._wake.set()

    def saw_missing(self, hashes: Sequence[bytes]) -> None:
        with self._lock:
            gone = [h for h in hashes if h in self._reported]
            for h in gone:
                del self._reported[h]
            if gone:
                self._events.append(BlockRemoved(tuple(gone)))

    def take(self) -> list[KVEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._poll_s)
            self._wake.clear()
            time.sleep(self._poll_s)  # let saves of this step land before asking
            try:
                self._poll()
            except StoreBackendError as e:
                log.debug("store events: exists check failed: %s", e)
            except Exception:  # never let the event thread die
                log.exception("store events: poll failed")

    def _poll(self) -> None:
        s = self._layout.store_tp_size
        with self._lock:
            batch = list(self._pending.items())[:MAX_KEYS_PER_POLL // s]
        if not batch:
            return
        hashes = [h for h, _ in batch]
        present = self._layout.blocks_present(hashes, self._backend.batch_exists(self._layout.keys_for(hashes)))
        now = time.monotonic()
        stored: list[tuple[bytes, bytes | None]] = []
        with self._lock:
            for (h, (parent, deadline)), ok in zip(batch, present):
                if ok:
                    stored.append((h, parent))
                    self._pending.pop(h, None)
                    self._reported[h] = None
                    while len(self._reported) > MAX_TRACKED:
                        self._reported.popitem(last=False)
                elif now > deadline:
                    self._pending.pop(h, None)
            self._events.extend(BlockStored((h,), parent_hash=p) for h, p in stored)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)


__all__ = ["StoredBlockTracker"]
