"""Quarantine: extents of gone objects and arenas, held until no token can touch them any more.

Bytes of a gone object are reused only after every token that could touch them has expired
(free_at = max(lease_until, write_expiry) + grace; a gone arena's untaken space waits for its
fixed write_expiry + grace). `bytes` counts the held extents that are still live, so eviction
can tell space that will come back on its own from space objects hold.
"""

from __future__ import annotations

import heapq
import itertools

from .entities import Placement, Segment


class Quarantine:
    def __init__(self) -> None:
        self.heap: list[tuple[int, int, list[Placement]]] = []  # (free_at, seq, extents)
        self.bytes = 0
        self._seq = itertools.count()

    def hold(self, extents: list[Placement], free_at: int, live_bytes: int) -> None:
        heapq.heappush(self.heap, (free_at, next(self._seq), extents))
        self.bytes += live_bytes

    def pop_due(self, now: int) -> list[list[Placement]]:
        """The held extents whose free_at has come, oldest first (the caller frees them)."""
        due = []
        while self.heap and self.heap[0][0] <= now:
            due.append(heapq.heappop(self.heap)[2])
        return due

    def forget(self, segments: list[Segment]) -> None:
        """The segments are gone: what is held on them no longer counts (it is skipped when due)."""
        for seg in segments:
            self.bytes -= sum(p.alloc_size for _, _, extents in self.heap for p in extents if p.seg is seg)

    def reorder(self) -> None:
        """Restore the heap order after the entries were loaded from a snapshot."""
        heapq.heapify(self.heap)


__all__ = ["Quarantine"]
