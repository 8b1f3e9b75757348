"""BlockPool: ref counts, LRU eviction of free cached blocks, KV events."""

from __future__ import annotations

import pytest

from pdcluster.engine import block_pool as bp
from pdcluster.engine.block_pool import AllBlocksCleared, BlockPool, BlockRemoved, BlockStored


def _h(i: int) -> bytes:
    return bytes([i]) * 32


def _cache(pool: BlockPool, blocks: list, first_hash: int = 1) -> list[bytes]:
    hashes = [_h(first_hash + i) for i in range(len(blocks))]
    pool.cache_full_blocks(blocks, hashes, 0, len(blocks), block_size=4)
    return hashes


def test_ref_counting_and_free_list() -> None:
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    assert (a.ref_cnt, b.ref_cnt, pool.num_free_blocks) == (1, 1, 2)
    pool.touch([a])
    assert a.ref_cnt == 2
    pool.free_blocks([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 2  # still referenced: not free
    pool.free_blocks([a, b])
    assert pool.num_free_blocks == 4 and pool.usage == 0.0
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([a])
    with pytest.raises(ValueError, match="only 4 free"):
        pool.get_new_blocks(5)


def test_lru_eviction_least_recently_freed_cached_block_first() -> None:
    pool = BlockPool(3, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    hashes = _cache(pool, blocks)
    pool.take_events()
    # Free tail first, as the manager does: block 2, then 1, then 0.
    pool.free_blocks(reversed(blocks))
    assert pool.num_free_blocks == 3 and pool.stats().num_cached_blocks == 3
    (new,) = pool.get_new_blocks(1)
    assert new is blocks[2] and new.block_hash is None  # the tail went first
    assert pool.get_cached_block(hashes[2]) is None and pool.get_cached_block(hashes[0]) is blocks[0]
    assert pool.take_events() == [BlockRemoved((hashes[2],))]
    assert pool.stats().num_evictions == 1


def test_hit_on_free_cached_block_takes_it_off_the_free_list() -> None:
    pool = BlockPool(3, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    hashes = _cache(pool, blocks)
    pool.free_blocks(reversed(blocks))
    hit = pool.get_cached_block(hashes[2])
    pool.touch([hit])  # the next LRU victim is hit again: it must survive allocations
    assert pool.num_free_blocks == 2
    got = pool.get_new_blocks(2)
    assert hit not in got and hit.block_hash == hashes[2]
    # Freed again, it goes to the back: most recently freed is evicted last.
    pool.free_blocks(got)
    pool.free_blocks([hit])
    assert pool.get_new_blocks(3)[-1] is hit


def test_uncached_free_blocks_are_reused_before_cached_ones() -> None:
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(4)
    _cache(pool, blocks[:2])
    pool.free_blocks(blocks)  # cached 0, 1 then uncached 2, 3
    assert {b.block_id for b in pool.get_new_blocks(2)} == {2, 3}
    assert pool.stats().num_cached_blocks == 2


def test_duplicate_hash_keeps_the_first_block() -> None:
    pool = BlockPool(2, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [_h(1)], 0, 1, 4)
    pool.cache_full_blocks([b], [_h(1)], 0, 1, 4)
    assert pool.get_cached_block(_h(1)) is a and b.block_hash is None
    pool.free_blocks([a, b])
    assert pool.get_new_blocks(1)[0] is b  # the private duplicate is reused first


def test_stored_events_carry_chain_and_tokens() -> None:
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    hashes = [_h(1), _h(2), _h(3)]
    pool.cache_full_blocks(blocks, hashes, 0, 1, 2, token_ids=[5, 6])
    pool.cache_full_blocks(blocks, hashes, 1, 3, 2, token_ids=[7, 8, 9, 10])
    assert pool.take_events() == [BlockStored((_h(1),), None, (5, 6), 2),
                                  BlockStored((_h(2), _h(3)), _h(1), (7, 8, 9, 10), 2)]
    assert pool.take_events() == []


def test_no_caching_no_hits_no_events() -> None:
    pool = BlockPool(2, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    _cache(pool, blocks)
    assert pool.get_cached_block(_h(1)) is None and pool.take_events() == []


def test_reset_prefix_cache_refused_while_blocks_in_use() -> None:
    pool = BlockPool(2, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    hashes = _cache(pool, blocks)
    assert pool.reset_prefix_cache() is False
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(hashes[0]) is None and pool.stats().num_cached_blocks == 0
    assert pool.take_events() == [AllBlocksCleared()]


def test_evict_blocks_unpublishes_bad_blocks() -> None:
    pool = BlockPool(3, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    hashes = _cache(pool, blocks)
    pool.take_events()
    pool.evict_blocks([1, 99])  # unknown ids are ignored
    assert pool.get_cached_block(hashes[1]) is None and blocks[1].ref_cnt == 1
    assert pool.take_events() == [BlockRemoved((hashes[1],))]


def test_undrained_events_collapse_to_a_clear(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bp, "MAX_PENDING_EVENTS", 3)
    pool = BlockPool(8, enable_caching=True)
    blocks = pool.get_new_blocks(8)
    for i, b in enumerate(blocks):
        pool.cache_full_blocks([b], [_h(i + 1)], 0, 1, 4)
    events = pool.take_events()
    assert len(events) <= 3 and isinstance(events[0], AllBlocksCleared)
    assert pool.stats().num_dropped_events > 0
