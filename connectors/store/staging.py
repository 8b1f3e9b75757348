"""StagingRing: a FIFO arena of fixed-size slots between the paged cache and the store.

One slot holds one (block, shard) object. Runs of consecutive slots are handed out in order and
reclaimed in order (a freed run that is not the oldest waits until the older ones are freed), so
a run is always one contiguous strided tensor: the pack kernel writes a whole batch in one call,
and the backend moves each slot as one buffer. The arena is allocated once and registered with
the backend once (Mooncake moves bytes only between registered memory).

    slots  [ free | run A (oldest) | run B | run C (newest) | free ]
                    ^ tail                                   ^ head
    a run that does not fit before the end wraps to slot 0 (the end is skipped while B, C live)
"""

from __future__ import annotations

import threading
from collections import deque

import torch


class StagingRing:
    def __init__(self, slot_nbytes: int, num_slots: int) -> None:
        if slot_nbytes < 1 or num_slots < 1:
            raise ValueError(f"need a positive slot size and count, got {slot_nbytes} x {num_slots}")
        self.slot_nbytes = slot_nbytes
        self.num_slots = num_slots
        self.buffer = torch.empty(slot_nbytes * num_slots, dtype=torch.uint8)
        self._live: deque[list[int]] = deque()  # [start, end, freed], allocation order
        self._cond = threading.Condition()
        self._closed = False

    def _find(self, n: int) -> int | None:
        if not self._live:
            return 0
        tail, head = self._live[0][0], self._live[-1][1]
        if head > tail:  # live = [tail, head): room after head, else wrap to [0, tail)
            if n <= self.num_slots - head:
                return head
            return 0 if n <= tail else None
        return head if n <= tail - head else None  # wrapped: live = [tail, N) + [0, head)

    def alloc(self, n: int, timeout_s: float | None = 0.0) -> int | None:
        """First slot of a run of n, or None if none frees up within timeout_s (0: do not wait)."""
        if not 0 < n <= self.num_slots:
            return None
        with self._cond:
            start = self._find(n)
            if start is None and timeout_s != 0.0:
                self._cond.wait_for(lambda: self._closed or self._find(n) is not None, timeout_s)
                start = None if self._closed else self._find(n)
            if start is None:
                return None
            self._live.append([start, start + n, 0])
            return start

    def free(self, start: int) -> None:
        with self._cond:
            for run in self._live:
                if run[0] == start and not run[2]:
                    run[2] = 1
                    break
            else:
                raise ValueError(f"slot {start} is not the start of a live run")
            while self._live and self._live[0][2]:
                self._live.popleft()
            self._cond.notify_all()

    def slots(self, start: int, n: int) -> torch.Tensor:
        """(n, slot_nbytes) uint8 view of a run."""
        b = self.slot_nbytes
        return self.buffer[start * b:(start + n) * b].view(n, b)

    @property
    def num_live_runs(self) -> int:
        with self._cond:
            return len(self._live)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


__all__ = ["StagingRing"]
