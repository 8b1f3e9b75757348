"""EncoderCache: an engine-local LRU of encoder outputs keyed by mm_hash, bounded in bytes.

A repeated image (same preprocessed pixels, same encoder) runs the vision tower once per
instance while its output stays cached. Entries larger than the whole budget are not cached
(the caller still uses the output it computed). Requests that are consuming an output keep their
own reference (mm_embedder.py), so an eviction never takes embeddings from under a chunked
prefill: at worst a later request encodes the image again. Values are opaque (tensors); the
caller gives each one's size, so this module needs no torch.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass
class EncoderCacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    num_encoded: int = 0  # images the tower actually ran on (counted by the embedder)
    num_entries: int = 0
    nbytes: int = 0


class EncoderCache:
    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"encoder cache size must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self._nbytes = 0
        self.stats = EncoderCacheStats()

    def get(self, key: str) -> Any | None:
        entry = self._entries.get(key)
        if entry is None:
            self.stats.misses += 1
            return None
        self._entries.move_to_end(key)
        self.stats.hits += 1
        return entry[0]

    def put(self, key: str, value: Any, nbytes: int) -> None:
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        if nbytes > self.max_bytes:
            return
        while self._nbytes + nbytes > self.max_bytes:
            _, (_, size) = self._entries.popitem(last=False)
            self._nbytes -= size
            self.stats.evictions += 1
        self._entries[key] = (value, nbytes)
        self._nbytes += nbytes
        self._sync()

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def clear(self) -> None:
        self._entries.clear()
        self._nbytes = 0
        self._sync()

    def _sync(self) -> None:
        self.stats.num_entries, self.stats.nbytes = len(self._entries), self._nbytes
