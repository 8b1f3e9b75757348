"""BlockPool: the physical KV blocks, their ref counts, the free list and the prefix-cache map.

Invariants:
  - a block is in the free list  <=>  ref_cnt == 0
  - block.block_hash is not None  =>  cached[block.block_hash] is block (full, computed, shareable)
  - a free block may still be cached: it is reusable by a prefix hit until it is allocated anew

Free list order = eviction order (front is evicted first):

    front [uncached blocks .. | cached blocks, least recently freed .. most recently freed] back

Blocks without a hash go to the front because nothing can hit them; cached blocks go to the
back, so the cached block freed longest ago is evicted first (LRU). Callers free a request's
blocks tail first, so its later, less shareable blocks are evicted before its prefix.

Stored/removed hashes are recorded as KV events for the router's prefix index.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

# Pending events past this many collapse into one AllBlocksCleared (nobody is draining them);
# a consumer then under-estimates what is cached, which costs hit rate but is never wrong.
MAX_PENDING_EVENTS = 1 << 16


@dataclass(frozen=True)
class BlockStored:
    """block_hashes[0] chains on parent_hash (None: the first block); each next one on the last.
    token_ids (the blocks' tokens) and block_size are filled by the engine's pool; consumers that
    only index hashes ignore them."""

    block_hashes: tuple[bytes, ...]
    parent_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None
    block_size: int | None = None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set only while the block is in the prefix cache

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hash={h})"


@dataclass
class BlockPoolStats:
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_evictions: int
    num_dropped_events: int = field(default=0)


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool, enable_kv_events: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_kv_events = enable_kv_events and enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[bytes, KVCacheBlock] = {}
        self._events: list[KVEvent] = []
        self._num_evictions = 0
        self._num_dropped_events = 0

    # -- queries ----------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now (free cached blocks included: allocation evicts them)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def stats(self) -> BlockPoolStats:
        return BlockPoolStats(self.num_blocks, len(self._free), len(self._cached), self._num_evictions,
                              self._num_dropped_events)

    # -- ref counting -----------------------------------------------------------------------------
    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on blocks found in the prefix cache (pulls free ones off the free list)."""
        for b in blocks:
            if b.ref_cnt == 0:
                del self._free[b.block_id]
            b.ref_cnt += 1

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop num_blocks from the front of the free list (evicting their cached hashes), ref_cnt = 1."""
        if num_blocks > len(self._free):
            raise ValueError(f"cannot allocate {num_blocks} blocks: only {len(self._free)} free")
        out: list[KVCacheBlock] = []
        removed: list[bytes] = []
        for _ in range(num_blocks):
            _, b = self._free.popitem(last=False)
            if b.block_hash is not None:
                removed.append(b.block_hash)
                self._uncache(b)
                self._num_evictions += 1
            b.ref_cnt = 1
            out.append(b)
        if removed:
            self._emit(BlockRemoved(tuple(removed)))
        return out

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block, in the order given (pass a request's blocks reversed)."""
        for b in blocks:
            if b.ref_cnt <= 0:
                raise ValueError(f"double free of {b}")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self._free[b.block_id] = b
                if b.block_hash is None:
                    self._free.move_to_end(b.block_id, last=False)

    # -- prefix cache -----------------------------------------------------------------------------
    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[bytes],
                          num_cached_blocks: int, num_full_blocks: int, block_size: int,
                          token_ids: Sequence[int] | None = None) -> None:
        """Publish blocks[num_cached_blocks:num_full_blocks] (full, KV computed) under their hashes.

        token_ids, if given, are the tokens of exactly those blocks (carried in the event). A hash
        already cached on another block (two requests computed the same block) keeps the first
        block; the duplicate stays private to its request and is freed as an uncached block.
        """
        if not self.enable_caching or num_full_blocks <= num_cached_blocks:
            return
        new_hashes = list(block_hashes[num_cached_blocks:num_full_blocks])
        for b, h in zip(blocks[num_cached_blocks:num_full_blocks], new_hashes):
            if b.block_hash is not None or h in self._cached:
                continue
            b.block_hash = h
            self._cached[h] = b
        parent = block_hashes[num_cached_blocks - 1] if num_cached_blocks > 0 else None
        self._emit(BlockStored(tuple(new_hashes), parent, tuple(token_ids) if token_ids is not None else None,
                               block_size))

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the cached hashes of these blocks (their KV is known to be bad); refs unchanged."""
        removed: list[bytes] = []
        for block_id in block_ids:
            if not 0 <= block_id < self.num_blocks:
                continue
            b = self.blocks[block_id]
            if b.block_hash is None:
                continue
            removed.append(b.block_hash)
            self._uncache(b)
            if b.ref_cnt == 0:
                self._free.move_to_end(block_id, last=False)
        if removed:
            self._emit(BlockRemoved(tuple(removed)))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any block is in use: running requests'
        bookkeeping assumes their published blocks stay published."""
        if len(self._free) != self.num_blocks:
            return False
        for b in self._cached.values():
            b.block_hash = None
        self._cached.clear()
        if self.enable_kv_events:
            self._events = [AllBlocksCleared()]
        return True

    def _uncache(self, b: KVCacheBlock) -> None:
        assert b.block_hash is not None and self._cached.get(b.block_hash) is b
        del self._cached[b.block_hash]
        b.block_hash = None

    # -- events -----------------------------------------------------------------------------------
    def _emit(self, event: KVEvent) -> None:
        if not self.enable_kv_events:
            return
        if len(self._events) >= MAX_PENDING_EVENTS:
            self._num_dropped_events += len(self._events)
            self._events = [AllBlocksCleared()]
        self._events.append(event)

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events


__all__ = ["AllBlocksCleared", "BlockPool", "BlockPoolStats", "BlockRemoved", "BlockStored", "KVCacheBlock",
           "KVEvent"]
