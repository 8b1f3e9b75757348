"""KVCacheManager: which blocks each request holds, and the prefix cache over them.

A request's block table, by token position (block_size = 4 here):

    tokens   | t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 .. .. |
    blocks   |    b7       |    b2       |    b9       |   (req_to_blocks[request_id])
    hashes   |    h0       |    h1       |   (partial: no hash yet)
             ^ cached ^^^^^^^^^^^^^^^^^^^  num_cached_blocks = 2

Invariants:
  - blocks[:num_cached_blocks[request_id]] are published in the prefix cache (or are duplicates of a
    published block); a block is published only once every one of its tokens' KV is computed
    (locally, or loaded by a connector whose load has finished)
  - allocate_slots either allocates everything asked for or changes nothing (returns None), except
    that blocks behind a sliding window (below) are freed either way
  - request.block_hashes[i] is the chained hash of tokens [i*bs, (i+1)*bs); hashes are computed
    for every full block, cached or not, so connectors and the router can use them as keys

Sliding window (`sliding_window` w: set only when EVERY layer slides, to the widest window; a
model with any full-attention layer reads every position, so nothing is freed). The token at
position p reads keys (p - w, p]; once a request has computed c tokens, no later token reads a
position below c - w + 1, so blocks wholly before it are freed (vLLM's SlidingWindowManager does
the same): their entries become `null_block`, a placeholder that holds no reference (its id, 0,
is never read: the attention backends read only a query's window). Freed blocks that were
published stay in the prefix cache until evicted. A prefix-cache hit needs only the blocks a
hit's end can still see: earlier ones are not held (placeholders), whether cached or not. The
same holds for tokens a connector loads (P2P sends only the window's tail): a new request's
blocks wholly behind its computed-plus-loaded point are placeholders from the start.

    tokens   | t0 .. t3 | t4 .. t7 | t8 .. t11 | t12 t13 |      w = 6, c = 14: keys >= 9 are read
    blocks   |   null   |   null   |    b9     |   b4    |      (9 // 4 = block 2 is the first held)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pdcluster.engine.block_hash import hash_block_tokens, salted
from pdcluster.engine.block_pool import BlockPool, KVCacheBlock, KVEvent
from pdcluster.engine.mm_inputs import block_extra_keys
from pdcluster.engine.request import Request


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def token_range(request: Request, start: int, end: int) -> list[int]:
    """request.all_token_ids[start:end] without concatenating the whole sequence."""
    prompt, n = request.prompt_token_ids, request.num_prompt_tokens
    if end <= n:
        return prompt[start:end]
    if start >= n:
        return request.output_token_ids[start - n:end - n]
    return prompt[start:] + request.output_token_ids[:end - n]


@dataclass
class KVCacheStats:
    num_blocks: int
    num_used_blocks: int  # ref_cnt > 0
    num_free_blocks: int  # allocatable, cached ones included
    num_cached_blocks: int  # published in the prefix cache (in use or free)
    usage: float
    prefix_queries: int  # tokens looked up (one lookup per request admission)
    prefix_hits: int  # of those, tokens served from the local prefix cache
    external_hits: int  # tokens served by a KV connector

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def as_stats(self) -> dict[str, int | float]:
        """The scheduler's get_stats() keys for these numbers."""
        return {
            "kv_cache_usage": self.usage,
            "kv_blocks_total": self.num_blocks,
            "kv_blocks_used": self.num_used_blocks,
            "kv_blocks_free": self.num_free_blocks,
            "kv_blocks_cached": self.num_cached_blocks,
            "prefix_cache_queries": self.prefix_queries,
            "prefix_cache_hits": self.prefix_hits,
            "prefix_cache_hit_rate": self.prefix_hit_rate,
            "external_prefix_hits": self.external_hits,
        }


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, max_model_len: int,
                 enable_kv_events: bool = True, sliding_window: int | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.sliding_window = sliding_window
        self.pool = BlockPool(num_blocks, enable_caching, enable_kv_events)
        self.null_block = KVCacheBlock(0)  # placeholder for a block behind the window (not in the pool)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.num_skipped_blocks: dict[str, int] = {}  # leading null_block entries per request
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._external_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def update_block_hashes(self, request: Request) -> None:
        """Extend request.block_hashes to cover every full block of its tokens (incremental)."""
        block_size, hashes, mm = self.block_size, request.block_hashes, request.mm_features
        for i in range(len(hashes), request.num_tokens // block_size):
            parent = hashes[-1] if hashes else None
            start, end = i * block_size, (i + 1) * block_size
            # A block covering an image's placeholders is keyed by that image too (mm_inputs.py).
            extra = block_extra_keys(mm, start, end) if mm else None
            if i == 0:
                extra = salted(extra, request.sampling_params.cache_salt)
            hashes.append(hash_block_tokens(parent, token_range(request, start, end), extra))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks from the start of the request's tokens.

        Never covers the last token: its logits must be computed. Takes no references; pass the
        result to allocate_slots in the same step (nothing may allocate in between).
        """
        self.update_block_hashes(request)
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        if self.sliding_window is not None:
            return self._window_hit(request.block_hashes[:max_blocks])
        hits: list[KVCacheBlock] = []
        for h in request.block_hashes[:max_blocks]:
            b = self.pool.get_cached_block(h)
            if b is None:
                break
            hits.append(b)
        return hits, len(hits) * self.block_size

    def _first_needed_block(self, num_computed_tokens: int) -> int:
        """The first block a token computed after num_computed_tokens can still read."""
        assert self.sliding_window is not None
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    def _window_hit(self, hashes: list[bytes]) -> tuple[list[KVCacheBlock], int]:
        """Longest hit of k blocks whose last blocks, those the (k * bs)-th token's window covers,
        are all cached; the blocks before them are placeholders (not held, not needed)."""
        found = [self.pool.get_cached_block(h) for h in hashes]
        best, run = 0, 0
        for k in range(1, len(found) + 1):
            run = run + 1 if found[k - 1] is not None else 0
            if run >= k - self._first_needed_block(k * self.block_size):
                best = k
        skip = self._first_needed_block(best * self.block_size)
        hits = [self.null_block] * skip + [b for b in found[skip:best] if b is not None]
        return hits, best * self.block_size

    def _free_behind_window(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the request's blocks that no token after num_computed_tokens reads (tail first)."""
        blocks = self.req_to_blocks.get(request_id)
        if self.sliding_window is None or not blocks:
            return
        skipped = self.num_skipped_blocks.get(request_id, 0)
        first = min(self._first_needed_block(num_computed_tokens), len(blocks))
        if first <= skipped:
            return
        freed = [b for b in blocks[skipped:first] if b is not self.null_block]
        blocks[skipped:first] = [self.null_block] * (first - skipped)
        self.num_skipped_blocks[request_id] = first
        self.pool.free_blocks(reversed(freed))

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       num_external_tokens: int = 0) -> list[int] | None:
        """Make room for the KV of request.num_computed_tokens + num_new_computed_tokens (prefix hits,
        covered by new_computed_blocks) + num_external_tokens (a connector loads them) +
        num_new_tokens (computed this step).

        Returns the ids of the blocks appended to the request's block table ([] when none were
        needed), or None when the free blocks do not suffice; then nothing changed.
        """
        new_computed_blocks = new_computed_blocks or []
        request_id = request.request_id
        held = self.req_to_blocks.get(request_id)
        if new_computed_blocks and held:
            raise ValueError(f"{request_id}: prefix-cache hits can only be added to a request without blocks")
        if num_new_computed_tokens != len(new_computed_blocks) * self.block_size:
            raise ValueError(f"{request_id}: num_new_computed_tokens does not match new_computed_blocks")
        num_done = request.num_computed_tokens + num_new_computed_tokens + num_external_tokens
        num_tokens = num_done + num_new_tokens
        if num_tokens > self.max_model_len:
            raise ValueError(f"{request_id}: {num_tokens} tokens exceed max_model_len={self.max_model_len}")
        self._free_behind_window(request_id, request.num_computed_tokens)
        num_held = len(held) if held else 0
        # Window: a new request's blocks wholly behind num_done are placeholders, hits there are not
        # held and a connector loads nothing there; a held one whose computed point moved back (a
        # failed load cut it) gets real blocks again where its window now reads (`remake`).
        lead = remake = 0
        if self.sliding_window is not None and held is None:
            lead = self._first_needed_block(num_done)
            new_computed_blocks = [self.null_block] * min(lead, len(new_computed_blocks)) + new_computed_blocks[lead:]
        elif self.sliding_window is not None:
            need_from = self._first_needed_block(request.num_computed_tokens)
            remake = max(0, min(self.num_skipped_blocks.get(request_id, 0), num_held) - need_from)
        num_lead = max(0, lead - len(new_computed_blocks))  # placeholders after the hits
        num_to_allocate = max(0, _cdiv(num_tokens, self.block_size) - num_held - len(new_computed_blocks)
                              - num_lead) + remake
        # Hits sitting in the free list stop being allocatable once touched (placeholders hold nothing).
        held_hits = [b for b in new_computed_blocks if b is not self.null_block]
        num_free_hits = sum(1 for b in held_hits if b.ref_cnt == 0)
        if num_to_allocate > self.pool.num_free_blocks - num_free_hits:
            return None

        if held is None:
            held = self.req_to_blocks[request_id] = []
            self.num_cached_blocks[request_id] = len(new_computed_blocks)
            self.num_skipped_blocks[request_id] = len(new_computed_blocks) - len(held_hits) + num_lead
            # One lookup per admission (a resumed request counts again: it looked up again).
            self._prefix_queries += request.num_tokens
            self._prefix_hits += num_new_computed_tokens
            self._external_hits += num_external_tokens
        self.pool.touch(held_hits)
        new_blocks = self.pool.get_new_blocks(num_to_allocate)
        if remake:
            start = self.num_skipped_blocks[request_id] - remake
            held[start:start + remake] = new_blocks[:remake]
            new_blocks = new_blocks[remake:]
            self.num_skipped_blocks[request_id] = start
            # They are recomputed: publish them (again) from there once they are.
            self.num_cached_blocks[request_id] = min(self.num_cached_blocks[request_id], start)
        held.extend(new_computed_blocks)
        held.extend([self.null_block] * num_lead)
        held.extend(new_blocks)
        return [b.block_id for b in new_computed_blocks] + [0] * num_lead + [b.block_id for b in new_blocks]

    def recompute_point(self, request_id: str, num_tokens: int) -> int:
        """Where a request whose KV from num_tokens on is bad can resume: num_tokens, unless a
        token there would read a placeholder (nothing kept that far back): then 0."""
        if self.sliding_window is None or num_tokens == 0:
            return num_tokens
        skipped = self.num_skipped_blocks.get(request_id, 0)
        return num_tokens if self._first_needed_block(num_tokens) >= skipped else 0

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Publish the request's blocks that num_computed_tokens made full. Call after every step
        (and when a connector's load finishes) with the tokens whose KV is now in the cache."""
        self.update_block_hashes(request)
        request_id = request.request_id
        blocks = self.req_to_blocks.get(request_id)
        if not self.enable_caching or not blocks:
            return
        # Placeholders are never published (an invalidation may have cut the count back past them).
        num_cached = max(self.num_cached_blocks[request_id], self.num_skipped_blocks.get(request_id, 0))
        num_full = min(num_computed_tokens // self.block_size, len(request.block_hashes), len(blocks))
        if num_full <= num_cached:
            return
        block_size = self.block_size
        tokens = (token_range(request, num_cached * block_size, num_full * block_size)
                  if self.pool.enable_kv_events else None)
        self.pool.cache_full_blocks(blocks, request.block_hashes, num_cached, num_full, block_size, tokens)
        self.num_cached_blocks[request_id] = num_full

    def invalidate_blocks(self, block_ids: Iterable[int]) -> None:
        """Unpublish blocks whose KV is bad (a failed transfer). Requests holding them keep them;
        their published prefix is cut back to before their first bad block."""
        bad = set(block_ids)
        self.pool.evict_blocks(bad)
        for request_id, blocks in self.req_to_blocks.items():
            for i, b in enumerate(blocks[:self.num_cached_blocks[request_id]]):
                if b is not self.null_block and b.block_id in bad:
                    self.num_cached_blocks[request_id] = i
                    break

    def free(self, request: Request) -> None:
        """Release the request's blocks (no-op when it holds none). Tail first: see BlockPool."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        self.num_skipped_blocks.pop(request.request_id, None)
        if blocks:
            self.pool.free_blocks(b for b in reversed(blocks) if b is not self.null_block)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def take_events(self) -> list[KVEvent]:
        return self.pool.take_events()

    def make_stats(self) -> KVCacheStats:
        s = self.pool.stats()
        return KVCacheStats(
            num_blocks=s.num_blocks,
            num_used_blocks=s.num_blocks - s.num_free_blocks,
            num_free_blocks=s.num_free_blocks,
            num_cached_blocks=s.num_cached_blocks,
            usage=self.pool.usage,
            prefix_queries=self._prefix_queries,
            prefix_hits=self._prefix_hits,
            external_hits=self._external_hits,
        )


__all__ = ["KVCacheManager", "KVCacheStats", "token_range"]
