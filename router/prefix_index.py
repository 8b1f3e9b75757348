"""PrefixIndex: which worker holds which KV blocks, by chained block hash.

Block hashes are chained (hash of the parent hash + the block's tokens), so one hash names a
whole prefix: a worker holding hash h_i of a request holds the KV of tokens [0, (i+1) * block_size)
-- provided it also holds h_0 .. h_{i-1}, which is how engines look prefixes up (they stop at the
first miss). `match` therefore counts each worker's CONTIGUOUS run of hashes from the start:

    request chain:  h0  h1  h2  h3
    worker A:       x   x   x   .     -> 3 blocks
    worker B:       x   .   x   x     -> 1 block (h2, h3 are unreachable without h1)

Two maps kept in sync:  worker -> OrderedDict(hash) (insertion/refresh order, for eviction)
                        hash -> set(workers)        (for matching)

Memory is bounded per worker (max_blocks_per_worker): past it the least recently stored hashes
are dropped. The index is a routing hint, never a correctness input, so forgetting is safe; it
only costs a worse routing decision. Pure data structure: no I/O, no locks (one owner thread).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

BlockHash = bytes

DEFAULT_MAX_BLOCKS_PER_WORKER = 1 << 20  # ~1M blocks x ~200 B of dict/set overhead per entry


class PrefixIndex:
    def __init__(self, max_blocks_per_worker: int = DEFAULT_MAX_BLOCKS_PER_WORKER) -> None:
        if max_blocks_per_worker < 1:
            raise ValueError("max_blocks_per_worker must be at least 1")
        self.max_blocks_per_worker = max_blocks_per_worker
        self._by_worker: dict[str, OrderedDict[BlockHash, None]] = {}
        self._by_hash: dict[BlockHash, set[str]] = {}
        self.num_evicted = 0  # hashes dropped for the memory bound (a metric)

    # -- updates ------------------------------------------------------------------------------
    def add_blocks(self, worker_id: str, block_hashes: Iterable[BlockHash]) -> None:
        """Record that worker_id now caches these blocks (KV event: stored)."""
        blocks = self._by_worker.setdefault(worker_id, OrderedDict())
        for h in block_hashes:
            if h in blocks:
                blocks.move_to_end(h)  # stored again: most recent
                continue
            blocks[h] = None
            self._by_hash.setdefault(h, set()).add(worker_id)
        while len(blocks) > self.max_blocks_per_worker:
            oldest, _ = blocks.popitem(last=False)
            self._unlink(oldest, worker_id)
            self.num_evicted += 1

    def remove_blocks(self, worker_id: str, block_hashes: Iterable[BlockHash]) -> None:
        """Record that worker_id evicted these blocks (KV event: removed). Unknown ones are
        ignored: removals of blocks we already forgot (memory bound) are normal."""
        blocks = self._by_worker.get(worker_id)
        if blocks is None:
            return
        for h in block_hashes:
            if h in blocks:
                del blocks[h]
                self._unlink(h, worker_id)

    def clear_worker(self, worker_id: str) -> None:
        """Forget every block of worker_id but keep it known (KV event: all blocks cleared)."""
        blocks = self._by_worker.get(worker_id)
        if blocks is None:
            return
        for h in blocks:
            self._unlink(h, worker_id)
        blocks.clear()

    def remove_worker(self, worker_id: str) -> None:
        """Forget worker_id entirely (it left the cluster)."""
        self.clear_worker(worker_id)
        self._by_worker.pop(worker_id, None)

    def replace_worker(self, worker_id: str, block_hashes: Iterable[BlockHash]) -> None:
        """Set worker_id's blocks to exactly block_hashes (a snapshot). The new set is built
        before the old one is dropped, so a bad iterable leaves the index unchanged."""
        new = list(block_hashes)
        self.clear_worker(worker_id)
        self.add_blocks(worker_id, new)

    def _unlink(self, h: BlockHash, worker_id: str) -> None:
        holders = self._by_hash.get(h)
        if holders is not None:
            holders.discard(worker_id)
            if not holders:
                del self._by_hash[h]

    # -- queries ------------------------------------------------------------------------------
    def match(self, block_hashes: Sequence[BlockHash], workers: Iterable[str] | None = None) -> dict[str, int]:
        """{worker_id: number of leading blocks of the chain it caches} for every worker with at
        least one (restricted to `workers` when given). O(chain length x candidates)."""
        result: dict[str, int] = {}
        if not block_hashes:
            return result
        candidates = set(self._by_hash.get(block_hashes[0], ()))
        if workers is not None:
            candidates &= set(workers)
        for i, h in enumerate(block_hashes):
            if not candidates:
                break
            holders = self._by_hash.get(h, ())
            dropped = [w for w in candidates if w not in holders]
            for w in dropped:
                result[w] = i
                candidates.discard(w)
        for w in candidates:  # held the whole chain
            result[w] = len(block_hashes)
        return {w: n for w, n in result.items() if n > 0}

    def num_blocks(self, worker_id: str) -> int:
        return len(self._by_worker.get(worker_id, ()))

    def contains(self, worker_id: str, block_hash: BlockHash) -> bool:
        return block_hash in self._by_worker.get(worker_id, ())

    def block_hashes(self, worker_id: str) -> list[BlockHash]:
        return list(self._by_worker.get(worker_id, ()))

    @property
    def workers(self) -> list[str]:
        return list(self._by_worker)

    def __len__(self) -> int:
        """Distinct block hashes held by any worker."""
        return len(self._by_hash)
