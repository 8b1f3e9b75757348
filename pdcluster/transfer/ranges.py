"""RangeIndex: a range list with its prefix sums, so any window's pieces cost O(log n + pieces).

A transfer's bytes are the concatenation of its ranges (protocol.py). Both ends cut windows out
of that concatenation for every request: the server to find the region pieces it sends, the
P2P reader to find the destination pieces it receives into. protocol.window_segments walks the
whole list per window, which at 64 KiB blocks (thousands of ranges) and many windows per
transfer was milliseconds of Python per request on each side; here the list is indexed once
per transfer (per connection on the server, see TableCache) and each window bisects into it.
"""

from __future__ import annotations

import struct
from array import array
from bisect import bisect_right
from collections.abc import Iterable
from itertools import accumulate, chain

from .protocol import RANGE


class RangeIndex:
    """Immutable view of (offset, length) ranges: total, bounds and windows of their concatenation.

    Compact, since the server keeps one per connection: the ranges as their wire table (16 B
    each) and the prefix sums as an array (8 B each), not Python tuples (~160 B per range)."""

    __slots__ = ("_table", "_starts", "total", "max_end", "min_len")

    def __init__(self, ranges: Iterable[tuple[int, int]]) -> None:
        flat = list(chain.from_iterable(ranges))
        self._init(struct.pack(f"!{len(flat)}Q", *flat), flat[1::2], flat[0::2])

    @classmethod
    def from_table(cls, table: bytes | memoryview, num_ranges: int) -> RangeIndex:
        """From the wire's range table (num_ranges x RANGE, protocol.py)."""
        raw = bytes(table[:num_ranges * RANGE.size])
        flat = struct.unpack(f"!{2 * num_ranges}Q", raw)
        self = cls.__new__(cls)
        self._init(raw, flat[1::2], flat[0::2])
        return self

    def _init(self, table: bytes, lengths: list[int] | tuple[int, ...], offsets: list[int] | tuple[int, ...]) -> None:
        self._table = table
        self._starts = array("Q", accumulate(lengths, initial=0))  # _starts[i] = bytes before range i
        self.total = self._starts[-1]
        self.max_end = max(map(int.__add__, offsets, lengths), default=0)
        self.min_len = min(lengths, default=0)

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return list(RANGE.iter_unpack(self._table))

    def __len__(self) -> int:
        return len(self._starts) - 1

    def window(self, start: int, length: int) -> list[tuple[int, int]]:
        """(offset, length) pieces covering bytes [start, start+length) of the concatenation, in
        order; the same list as protocol.window_segments(self.ranges, start, length)."""
        out: list[tuple[int, int]] = []
        if length <= 0:
            return out
        end = start + length
        starts, table, n_ranges = self._starts, self._table, len(self._starts) - 1
        i = max(0, bisect_right(starts, start) - 1)
        while i < n_ranges and starts[i] < end:
            off, n = RANGE.unpack_from(table, i * RANGE.size)
            pos = starts[i]
            lo, hi = max(start, pos), min(end, pos + n)
            if lo < hi:
                out.append((off + lo - pos, hi - lo))
            i += 1
        return out


class TableCache:
    """The last range table a connection was shown, indexed, keyed by the exact token and table
    bytes. A P2P reader sends the same token and table with every window of a transfer; a hit
    skips re-parsing, re-digesting and re-indexing them. Sound because what is cached (the
    parsed ranges and that the token's ranges digest matched them) is a function of exactly
    those bytes; everything that is not (expiry, revocation, single use, the region's size) is
    still checked per request by the server."""

    __slots__ = ("_key", "_index")

    def __init__(self) -> None:
        self._key: bytes | None = None
        self._index: RangeIndex | None = None

    def get(self, key: bytes) -> RangeIndex | None:
        return self._index if key == self._key else None

    def put(self, key: bytes, index: RangeIndex) -> None:
        self._key, self._index = key, index
