"""Producer-side leases: which finished requests' blocks a consumer may still read, and until when.

    add()  (engine thread, the step after request_finished said delay_free)
      |                      renew() by heartbeat pushes expiry forward
      v
    ACTIVE --release() ("done" notice)--> RELEASED --+
      |                                              +--> request id in take_finished() once:
      +------ expire() / any lookup after expiry --> EXPIRED -+   the scheduler frees the blocks
      |                                              |
      +------ drop_request() (request aborted) ----> ABORTED -+

Invariants:
  - a lease ends exactly once (released, expired or aborted) and its request id is reported
    exactly once; nothing ends it before expiry except its consumer's "done" or the producer
    engine's abort of the request (then nobody will take the hand-off);
  - states only move forward, so a consumer that gets "released" for its own "done" knows the
    lease was alive for every read it made before: blocks are freed (and may be reused) only
    after the lease ended;
  - expiry does not assume any order: expire() looks at every lease;
  - ended leases are remembered (bounded) so a late reader learns "expired"/"released" rather
    than "unknown";
  - the first consumer that opens (or ends) a lease owns it: later opens, heartbeats and
    "done"s from another authenticated sender (its CURVE key name, the ZAP User-Id) are refused
    ("wrong_owner"), so knowing a lease's ids is not enough to read, renew or end it;
  - a data-plane token dies with its lease: the producer's TransferServer asks transfer_live()
    on every request, so a token of an ended lease is refused although it has not expired.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

_MAX_TOMBSTONES = 4096


class LeaseError(Exception):
    """A lease lookup failed; `reason` is one of unknown, expired, released, wrong_request,
    wrong_transfer (also the metric label and the error the consumer sees)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class Lease:
    lease_id: str
    transfer_id: str
    request_id: str
    block_ids: list[int]
    expiry: float  # clock() seconds
    notified: set[int] = field(default_factory=set)  # consumer ranks that said done (TP)
    owner: str | None = None  # the authenticated consumer that first used it (ZAP User-Id)


class LeaseTable:
    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._active: dict[str, Lease] = {}
        self._ended: OrderedDict[str, tuple[str, str]] = OrderedDict()  # lease_id -> (state, transfer_id)
        self._by_transfer: dict[str, set[str]] = {}  # transfer_id -> its active lease ids
        self._finished: set[str] = set()
        self.counts = {"created": 0, "released": 0, "expired": 0, "aborted": 0}
        self.on_finished: Callable[[], None] = lambda: None  # the engine's wake-up (set_wakeup); never blocks

    def add(self, request_id: str, transfer_id: str, lease_id: str, block_ids: list[int]) -> Lease:
        with self._lock:
            if lease_id in self._active or lease_id in self._ended:
                raise ValueError(f"lease id {lease_id} already used")
            lease = Lease(lease_id, transfer_id, request_id, list(block_ids), self._clock() + self.ttl_s)
            self._active[lease_id] = lease
            self._by_transfer.setdefault(transfer_id, set()).add(lease_id)
            self.counts["created"] += 1
            return lease

    def lookup(self, lease_id: str, transfer_id: str, request_id: str | None = None,
               sender: str | None = None) -> Lease:
        """The live lease, checked against the transfer (and request) it is bound to, and against
        its owner when the caller names the authenticated `sender` (the first one becomes it)."""
        with self._lock:
            lease = self._live(lease_id)
            if lease.transfer_id != transfer_id:
                raise LeaseError("wrong_transfer")
            if request_id is not None and lease.request_id != request_id:
                raise LeaseError("wrong_request")
            if not self._owned_by(lease, sender):
                raise LeaseError("wrong_owner")
            return lease

    def transfer_live(self, transfer_id: str) -> bool:
        """Some lease of this transfer is active and unexpired (the data-plane token check)."""
        with self._lock:
            for lease_id in list(self._by_transfer.get(transfer_id, ())):
                try:
                    self._live(lease_id)
                    return True
                except LeaseError:
                    continue
            return False

    def remaining_s(self, lease: Lease) -> float:
        return max(0.0, lease.expiry - self._clock())

    def renew(self, lease_id: str, transfer_id: str, sender: str | None = None) -> bool:
        with self._lock:
            try:
                lease = self._live(lease_id)
            except LeaseError:
                return False
            if lease.transfer_id != transfer_id or not self._owned_by(lease, sender):
                return False
            lease.expiry = self._clock() + self.ttl_s
            return True

    def release(self, lease_id: str, transfer_id: str, request_id: str, consumer_rank: int = 0,
                expected: int = 1, sender: str | None = None) -> str:
        """The consumer's "done": "released", or why not (expired, released, unknown, wrong_*).
        With TP the lease ends only when `expected` distinct consumer ranks said done; each of
        them gets "released" (the lease was alive for every read it made)."""
        with self._lock:
            try:
                lease = self._live(lease_id)
            except LeaseError as e:
                return e.reason
            if lease.transfer_id != transfer_id:
                return "wrong_transfer"
            if lease.request_id != request_id:
                return "wrong_request"
            if not self._owned_by(lease, sender):
                return "wrong_owner"
            lease.notified.add(consumer_rank)
            if len(lease.notified) >= expected:
                self._end(lease, "released")
            return "released"

    def drop_request(self, request_id: str) -> bool:
        """End the live lease(s) of an aborted request now; False if it had none (ended already,
        or this rank never got it). Later lookups of those leases fail with "aborted"."""
        with self._lock:
            gone = [lease for lease in self._active.values() if lease.request_id == request_id]
            for lease in gone:
                self._end(lease, "aborted")
            return bool(gone)

    def expire(self) -> list[str]:
        """End every lease past its expiry; returns their request ids."""
        with self._lock:
            now = self._clock()
            gone = [lease for lease in self._active.values() if lease.expiry < now]
            for lease in gone:
                self._end(lease, "expired")
            return [lease.request_id for lease in gone]

    def end_all(self) -> None:
        """Shutdown: every lease ends (its blocks go back with the engine)."""
        with self._lock:
            for lease in list(self._active.values()):
                self._end(lease, "expired")

    def take_finished(self) -> set[str]:
        with self._lock:
            out, self._finished = self._finished, set()
            return out

    @property
    def num_active(self) -> int:
        with self._lock:
            return len(self._active)

    # -- under self._lock ------------------------------------------------------------------------
    @staticmethod
    def _owned_by(lease: Lease, sender: str | None) -> bool:
        """No sender named (in-process callers): not checked. Else the first sender owns it."""
        if sender is None:
            return True
        if lease.owner is None:
            lease.owner = sender
        return lease.owner == sender

    def _live(self, lease_id: str) -> Lease:
        lease = self._active.get(lease_id)
        if lease is None:
            ended = self._ended.get(lease_id)
            raise LeaseError(ended[0] if ended else "unknown")
        if lease.expiry < self._clock():  # expired, scan not yet run: end it now, never serve it
            self._end(lease, "expired")
            raise LeaseError("expired")
        return lease

    def _end(self, lease: Lease, state: str) -> None:
        del self._active[lease.lease_id]
        ids = self._by_transfer.get(lease.transfer_id)
        if ids is not None:
            ids.discard(lease.lease_id)
            if not ids:
                del self._by_transfer[lease.transfer_id]
        self._ended[lease.lease_id] = (state, lease.transfer_id)
        while len(self._ended) > _MAX_TOMBSTONES:
            self._ended.popitem(last=False)
        self._finished.add(lease.request_id)
        self.counts[state] += 1
        self.on_finished()
