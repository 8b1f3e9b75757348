"""ExtentAllocator: first-fit allocation of byte extents in one segment, with coalescing frees.

Metadata only -- it never touches the segment's memory. Sizes are rounded up to `align` so
objects start on cache-line (or larger) boundaries, which keeps tensor views over them aligned.

Invariant: the free extents are disjoint, non-adjacent (always coalesced) and sorted by offset;
`free_bytes + used == capacity`.
"""

from __future__ import annotations

import bisect


class ExtentAllocator:
    def __init__(self, capacity: int, align: int = 256) -> None:
        if capacity <= 0 or align <= 0 or align & (align - 1):
            raise ValueError("capacity must be positive and align a power of two")
        self.capacity = capacity - capacity % align
        self.align = align
        self._offsets: list[int] = [0] if self.capacity else []  # sorted free extent starts
        self._sizes: dict[int, int] = {0: self.capacity} if self.capacity else {}
        self.used = 0

    def round(self, size: int) -> int:
        return max(self.align, -(-size // self.align) * self.align)

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used

    def largest_free(self) -> int:
        return max(self._sizes.values(), default=0)

    def alloc(self, size: int) -> int | None:
        """Offset of a fresh extent of round(size) bytes, or None if no free extent fits."""
        need = self.round(size)
        for i, off in enumerate(self._offsets):
            have = self._sizes[off]
            if have >= need:
                del self._sizes[off]
                if have == need:
                    del self._offsets[i]
                else:
                    self._offsets[i] = off + need
                    self._sizes[off + need] = have - need
                self.used += need
                return off
        return None

    def reserve(self, offset: int, size: int) -> None:
        """Carve exactly [offset, offset+round(size)) out of free space (used by op-log replay)."""
        need = self.round(size)
        i = bisect.bisect_right(self._offsets, offset) - 1
        if i < 0 or offset % self.align:
            raise ValueError(f"extent {offset}+{need} is not free")
        start = self._offsets[i]
        have = self._sizes[start]
        if offset + need > start + have:
            raise ValueError(f"extent {offset}+{need} is not free")
        del self._offsets[i]
        del self._sizes[start]
        for s, n in ((start, offset - start), (offset + need, start + have - offset - need)):
            if n:
                bisect.insort(self._offsets, s)
                self._sizes[s] = n
        self.used += need

    def free(self, offset: int, size: int) -> None:
        """Return an extent; merges with free neighbours. Freeing free space is a bug and raises."""
        n = self.round(size)
        i = bisect.bisect_left(self._offsets, offset)
        prev_ok = i == 0 or self._offsets[i - 1] + self._sizes[self._offsets[i - 1]] <= offset
        next_ok = i == len(self._offsets) or offset + n <= self._offsets[i]
        if not (prev_ok and next_ok) or offset + n > self.capacity:
            raise ValueError(f"double free or bad extent {offset}+{n}")
        self.used -= n
        if i < len(self._offsets) and self._offsets[i] == offset + n:  # merge with next
            n += self._sizes.pop(self._offsets[i])
            del self._offsets[i]
        if i > 0 and self._offsets[i - 1] + self._sizes[self._offsets[i - 1]] == offset:  # merge with prev
            self._sizes[self._offsets[i - 1]] += n
            return
        self._offsets.insert(i, offset)
        self._sizes[offset] = n
