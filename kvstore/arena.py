"""Write arenas: one reservation, many objects, one CommitArena RPC per batch.

A client reserves an arena (one extent of `size` bytes per replica, on distinct nodes, with WRITE
tokens for the whole extent that expire at `write_expiry_ms`), copies objects into it, and
commits them as (key, offset, size). A committed object's placements are the subranges
[offset, offset + round(size)) of every replica's extent; from then on that subrange belongs to
the object (the object frees it when it goes), and the arena owns only what no object took.

Rules (enforced by MetadataStore, see metadata.py):
- The expiry is fixed at reserve time, never refreshed: every token for the arena dies then, so
  "expiry + grace" bounds every write that could ever land in its space. Commits after it fail.
- What the arena still owns when it goes (released, expired, or lost with a node) is quarantined
  until expiry + grace, never freed earlier -- the client holds a token for all of it. The space
  of items the master rejected stays in the arena, so it goes the same way.
- An object made from an arena keeps the arena's expiry as its write expiry, so removing or
  evicting it also waits for expiry + grace.
- Item ranges are aligned, inside the arena and disjoint from every object already made from it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from .entities import Placement


@dataclass(eq=False)
class Arena:
    arena_id: str
    size: int  # rounded; every replica's extent is exactly this long
    placements: list[Placement]  # the whole extent on each replica
    write_expiry_ms: int
    # Disjoint [start, end) ranges, relative to the extent, that objects took; sorted by start.
    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)

    def fits(self, offset: int, length: int, align: int) -> bool:
        """True if [offset, offset+length) is aligned, inside the arena and not yet taken."""
        if offset < 0 or length <= 0 or offset % align or offset + length > self.size:
            return False
        i = bisect.bisect_right(self.starts, offset)
        if i > 0 and self.ends[i - 1] > offset:
            return False
        return i == len(self.starts) or self.starts[i] >= offset + length

    def take(self, offset: int, length: int) -> None:
        i = bisect.bisect_right(self.starts, offset)
        self.starts.insert(i, offset)
        self.ends.insert(i, offset + length)

    def taken(self) -> list[tuple[int, int]]:
        return list(zip(self.starts, self.ends, strict=True))

    def free_pieces(self) -> list[tuple[int, int]]:
        """The [start, end) ranges the arena still owns: the complement of what objects took."""
        out, pos = [], 0
        for s, e in zip(self.starts, self.ends, strict=True):
            if s > pos:
                out.append((pos, s))
            pos = e
        if pos < self.size:
            out.append((pos, self.size))
        return out

    def owned_extents(self) -> list[Placement]:
        """free_pieces on every replica, as allocator extents."""
        return [Placement(p.seg, p.offset + s, e - s) for p in self.placements for s, e in self.free_pieces()]

    def sub_placements(self, offset: int, length: int) -> list[Placement]:
        return [Placement(p.seg, p.offset + offset, length) for p in self.placements]
