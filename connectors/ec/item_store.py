"""ItemStore: the producer's encoder outputs in one byte region, with states, leases and bounds.

    absent --reserve--> PENDING --save--> READY <--(first lease / last lease ends)--> PINNED
       ^                   | (reservation expires)    | LRU eviction (unleased only) or drop()
       +-------------------+                          v
                                                   EVICTED (a bounded memory of hashes, so a
                                                   consumer hears "evicted", not "missing")

A lease pins an item: announced items get one (request_finished), every fetch gets its own
"grant" (its data-plane token dies with it). While any lease or grant of an item is live its bytes
are neither evicted nor reused. Expiry is by a monotonic clock, scanned without assuming order.

Space: first fit in a sorted free list over [0, max_bytes), 64-byte aligned, neighbours coalesced;
to make room, unleased READY items are evicted least recently used first. Everything is guarded by
one lock (the engine thread saves, the control thread serves, both read states).
"""

from __future__ import annotations

import bisect
import secrets
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from pdcluster.engine.ec_connector import ECItemState

_ALIGN = 64
_MAX_TOMBSTONES = 4096


@dataclass
class Item:
    mm_hash: str
    state: ECItemState
    offset: int = 0
    nbytes: int = 0
    shape: tuple[int, ...] = ()
    dtype: str = ""
    digest: bytes = b""
    pending_until: float = 0.0
    leases: set[str] = field(default_factory=set)


@dataclass
class Lease:
    lease_id: str  # 32 hex
    mm_hash: str
    expires: float
    owner: str | None = None  # the ZAP User-Id that took it (grants); None for announced leases


class StoreFull(Exception):
    """No room even after evicting every unleased item (or max_items reached)."""


class ItemStore:
    def __init__(self, max_bytes: int, max_items: int, lease_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_bytes, self.max_items, self.lease_s = max_bytes, max_items, lease_s
        self._clock = clock
        self._lock = threading.Lock()
        self._items: OrderedDict[str, Item] = OrderedDict()  # LRU order: oldest first
        self._leases: dict[str, Lease] = {}
        self._evicted: OrderedDict[str, None] = OrderedDict()
        self._free: list[tuple[int, int]] = [(0, max_bytes)]  # sorted (offset, size) holes
        self.counts: Counter[str] = Counter()

    # -- states -----------------------------------------------------------------------------------
    def state(self, mm_hash: str) -> ECItemState:
        with self._lock:
            return self._state(mm_hash)

    def _state(self, mm_hash: str) -> ECItemState:
        item = self._items.get(mm_hash)
        if item is not None:
            return ECItemState.PINNED if item.state is ECItemState.READY and item.leases else item.state
        return ECItemState.EVICTED if mm_hash in self._evicted else ECItemState.ABSENT

    def reserve(self, mm_hash: str) -> None:
        """absent/evicted -> PENDING until saved (or lease_s passes: a failed encode does not leave
        consumers waiting on NOT_READY forever)."""
        with self._lock:
            if mm_hash in self._items or len(self._items) >= self.max_items:
                return
            self._evicted.pop(mm_hash, None)
            self._items[mm_hash] = Item(mm_hash, ECItemState.PENDING, pending_until=self._clock() + self.lease_s)

    def allocate(self, mm_hash: str, nbytes: int) -> int | None:
        """Space for a PENDING/absent item's bytes: its offset (the caller copies the bytes, then
        calls commit), or None if it is already READY. Raises StoreFull."""
        with self._lock:
            item = self._items.get(mm_hash)
            if item is not None and item.state is ECItemState.READY:
                return None
            if item is None and len(self._items) >= self.max_items and not self._evict_one():
                raise StoreFull(f"max_items={self.max_items} reached")
            offset = self._alloc(nbytes)
            if item is None:
                item = Item(mm_hash, ECItemState.PENDING)
                self._items[mm_hash] = item
                self._evicted.pop(mm_hash, None)
            item.offset, item.nbytes, item.pending_until = offset, nbytes, float("inf")  # copying
            return offset

    def commit(self, mm_hash: str, shape: tuple[int, ...], dtype: str, digest: bytes) -> None:
        """The bytes are in place: PENDING -> READY (only now servable)."""
        with self._lock:
            item = self._items[mm_hash]
            item.shape, item.dtype, item.digest, item.state = shape, dtype, digest, ECItemState.READY
            self._items.move_to_end(mm_hash)
            self.counts["saved"] += 1

    def abandon(self, mm_hash: str) -> None:
        """A save that failed after allocate: give the space back."""
        with self._lock:
            item = self._items.pop(mm_hash, None)
            if item is not None and item.nbytes:
                self._release_space(item.offset, item.nbytes)

    def get(self, mm_hash: str) -> Item | None:
        with self._lock:
            return self._items.get(mm_hash)

    # -- leases -----------------------------------------------------------------------------------
    def lease(self, mm_hash: str, owner: str | None = None) -> Lease | None:
        """A new lease pinning a READY item (touching it in the LRU); None when not READY."""
        with self._lock:
            item = self._items.get(mm_hash)
            if item is None or item.state is not ECItemState.READY:
                return None
            lease = Lease(secrets.token_hex(16), mm_hash, self._clock() + self.lease_s, owner)
            self._leases[lease.lease_id] = lease
            item.leases.add(lease.lease_id)
            self._items.move_to_end(mm_hash)
            self.counts["leases_granted"] += 1
            return lease

    def live_lease(self, lease_id: str, mm_hash: str | None = None) -> Lease | None:
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.expires <= self._clock() or (mm_hash and lease.mm_hash != mm_hash):
                return None
            return lease

    def release(self, lease_id: str, mm_hash: str, owner: str | None = None) -> bool:
        """End a lease; False if it was not live (already ended, expired, another item's, or a
        grant held by someone else)."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.mm_hash != mm_hash or (lease.owner is not None and lease.owner != owner):
                return False
            live = lease.expires > self._clock()
            self._end(lease)
            self.counts["leases_released" if live else "leases_expired"] += 1
            return live

    def expire(self) -> int:
        """End every expired lease and drop expired reservations; returns how many leases ended."""
        now = self._clock()
        with self._lock:
            dead = [lease for lease in self._leases.values() if lease.expires <= now]
            for lease in dead:
                self._end(lease)
            self.counts["leases_expired"] += len(dead)
            stale = [h for h, it in self._items.items() if it.state is ECItemState.PENDING and it.pending_until <= now]
            for h in stale:
                self._items.pop(h)
            return len(dead)

    def drop(self, mm_hash: str) -> bool:
        """Evict an item now, leases and all (memory pressure from outside, tests); its live grants
        die with it, so no token for its bytes can still be served."""
        with self._lock:
            item = self._items.get(mm_hash)
            if item is None or item.state is not ECItemState.READY:
                return False
            for lease_id in list(item.leases):
                self._end(self._leases[lease_id])
            self._evict(item)
            return True

    def _end(self, lease: Lease) -> None:
        self._leases.pop(lease.lease_id, None)
        item = self._items.get(lease.mm_hash)
        if item is not None:
            item.leases.discard(lease.lease_id)

    # -- space ------------------------------------------------------------------------------------
    def _alloc(self, nbytes: int) -> int:
        size = -(-max(1, nbytes) // _ALIGN) * _ALIGN
        if size > self.max_bytes:
            raise StoreFull(f"an item of {nbytes} bytes is larger than max_bytes={self.max_bytes}")
        while True:
            for i, (off, hole) in enumerate(self._free):
                if hole >= size:
                    self._free[i:i + 1] = [(off + size, hole - size)] if hole > size else []
                    return off
            if not self._evict_one():
                raise StoreFull(f"no room for {nbytes} bytes: every item is leased or pending")

    def _evict_one(self) -> bool:
        for item in self._items.values():  # least recently used first
            if item.state is ECItemState.READY and not item.leases:
                self._evict(item)
                return True
        return False

    def _evict(self, item: Item) -> None:
        self._items.pop(item.mm_hash, None)
        self._release_space(item.offset, item.nbytes)
        self._evicted[item.mm_hash] = None
        while len(self._evicted) > _MAX_TOMBSTONES:
            self._evicted.popitem(last=False)
        self.counts["evicted"] += 1

    def _release_space(self, offset: int, nbytes: int) -> None:
        size = -(-max(1, nbytes) // _ALIGN) * _ALIGN
        i = bisect.bisect(self._free, (offset, size))
        self._free.insert(i, (offset, size))
        # coalesce with the right, then the left neighbour
        if i + 1 < len(self._free) and offset + size == self._free[i + 1][0]:
            size += self._free.pop(i + 1)[1]
            self._free[i] = (offset, size)
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            prev = self._free.pop(i - 1)
            self._free[i - 1] = (prev[0], prev[1] + size)

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = {f"store_{k}": v for k, v in self.counts.items()}
            out["store_items"] = len(self._items)
            out["store_bytes"] = sum(it.nbytes for it in self._items.values())
            out["store_leases_active"] = len(self._leases)
            return out
