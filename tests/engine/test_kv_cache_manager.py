"""KVCacheManager: prefix hits, all-or-nothing allocation, publication only of computed blocks."""

from __future__ import annotations

import pytest

from pdcluster.engine.block_hash import compute_block_hashes
from pdcluster.engine.block_pool import BlockRemoved, BlockStored
from pdcluster.engine.kv_cache_manager import KVCacheManager, token_range
from pdcluster.engine.request import Request
from pdcluster.sampling_params import SamplingParams

BS = 4


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8))


def _compute(kv: KVCacheManager, req: Request, num_tokens: int) -> None:
    """What the scheduler does around one step: allocate, then publish once the KV is computed."""
    hits, num_hit = kv.get_computed_blocks(req) if req.request_id not in kv.req_to_blocks else ([], 0)
    assert kv.allocate_slots(req, num_tokens, num_hit, hits) is not None
    req.num_computed_tokens += num_hit + num_tokens
    kv.cache_blocks(req, req.num_computed_tokens)


def test_prefix_hit_reuses_blocks_and_counts_tokens() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=True, max_model_len=64)
    a = _req("a", list(range(10)))
    _compute(kv, a, 10)
    a_blocks = kv.get_block_ids("a")
    b = _req("b", list(range(8)) + [50, 51, 52])
    hits, num_hit = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == a_blocks[:2] and num_hit == 8
    new_ids = kv.allocate_slots(b, 3, num_hit, hits)
    assert new_ids[:2] == a_blocks[:2] and len(new_ids) == 3
    assert all(h.ref_cnt == 2 for h in hits)
    stats = kv.make_stats()
    assert (stats.prefix_queries, stats.prefix_hits) == (21, 8)
    assert stats.prefix_hit_rate == pytest.approx(8 / 21)


def test_never_hits_the_whole_prompt() -> None:
    kv = KVCacheManager(16, BS, True, 64)
    a = _req("a", list(range(8)))
    _compute(kv, a, 8)
    kv.free(a)
    hits, num_hit = kv.get_computed_blocks(_req("b", list(range(8))))
    assert num_hit == 4 and len(hits) == 1  # the last token must be computed for its logits


def test_allocation_failure_changes_nothing() -> None:
    kv = KVCacheManager(4, BS, True, 64)
    a = _req("a", list(range(8)))
    _compute(kv, a, 8)
    kv.free(a)  # two cached free blocks
    b = _req("b", list(range(8)) + list(range(100, 112)))  # 20 tokens: 5 blocks > 4
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    before = (kv.num_free_blocks, [h.ref_cnt for h in hits], kv.make_stats())
    assert kv.allocate_slots(b, 12, num_hit, hits) is None
    assert (kv.num_free_blocks, [h.ref_cnt for h in hits], kv.make_stats()) == before
    assert "b" not in kv.req_to_blocks
    # Free cached hits count as free blocks only once: 2 hits + 2 new = the 4 blocks.
    c = _req("c", list(range(8)) + list(range(100, 108)))
    hits, num_hit = kv.get_computed_blocks(c)
    assert kv.allocate_slots(c, 8, num_hit, hits) is not None and kv.num_free_blocks == 0


def test_blocks_published_only_once_computed() -> None:
    kv = KVCacheManager(8, BS, True, 64)
    a = _req("a", list(range(12)))
    assert kv.allocate_slots(a, 12) is not None  # 3 blocks, nothing computed yet
    assert kv.make_stats().num_cached_blocks == 0
    a.num_computed_tokens = 6
    kv.cache_blocks(a, 6)
    assert kv.make_stats().num_cached_blocks == 1
    events = kv.take_events()
    assert events == [BlockStored((a.block_hashes[0],), None, (0, 1, 2, 3), BS)]


def test_external_tokens_published_when_the_load_finishes() -> None:
    kv = KVCacheManager(8, BS, True, 64)
    a = _req("a", list(range(10)))
    ids = kv.allocate_slots(a, 0, num_external_tokens=9)
    assert len(ids) == 3 and kv.make_stats().external_hits == 9
    assert kv.make_stats().num_cached_blocks == 0  # loading: not shareable yet
    a.num_computed_tokens = 9
    kv.cache_blocks(a, 9)
    assert kv.make_stats().num_cached_blocks == 2
    assert kv.allocate_slots(a, 1) == []  # the last token fits in the third block


def test_block_hashes_follow_appended_tokens() -> None:
    kv = KVCacheManager(8, BS, True, 64)
    a = _req("a", list(range(6)))
    kv.update_block_hashes(a)
    assert len(a.block_hashes) == 1
    for t in (70, 71, 72):
        a.append_output_token(t)
    kv.update_block_hashes(a)
    assert a.block_hashes == compute_block_hashes(a.all_token_ids, BS)
    assert token_range(a, 4, 8) == [4, 5, 70, 71] and token_range(a, 7, 9) == [71, 72]


def test_free_is_tail_first_and_idempotent() -> None:
    kv = KVCacheManager(3, BS, True, 64)
    a = _req("a", list(range(13)))
    _compute(kv, a, 12)
    kv.take_events()
    kv.free(a)
    kv.free(a)
    assert kv.num_free_blocks == 3 and kv.usage == 0.0
    b = _req("b", [99] * 5)
    assert kv.allocate_slots(b, 5) is not None  # 2 blocks: evicts a's last two, keeps its first
    assert kv.take_events() == [BlockRemoved((a.block_hashes[2], a.block_hashes[1]))]
    assert kv.get_computed_blocks(_req("c", list(range(8))))[1] == 4


def test_invalidate_blocks_cuts_published_prefix() -> None:
    kv = KVCacheManager(8, BS, True, 64)
    a = _req("a", list(range(12)))
    _compute(kv, a, 12)
    bad = kv.get_block_ids("a")[1]
    kv.invalidate_blocks({bad})
    assert kv.num_cached_blocks["a"] == 1
    assert kv.get_computed_blocks(_req("b", list(range(12))))[1] == 4


def test_contract_violations_raise() -> None:
    kv = KVCacheManager(8, BS, True, 16)
    a = _req("a", list(range(8)))
    with pytest.raises(ValueError, match="max_model_len"):
        kv.allocate_slots(a, 17)
    with pytest.raises(ValueError, match="num_new_computed_tokens"):
        kv.allocate_slots(a, 1, num_new_computed_tokens=4)


def test_caching_disabled_never_hits() -> None:
    kv = KVCacheManager(8, BS, False, 64)
    a = _req("a", list(range(8)))
    _compute(kv, a, 8)
    kv.free(a)
    assert kv.get_computed_blocks(_req("b", list(range(8)))) == ([], 0)
    assert kv.take_events() == [] and kv.make_stats().num_cached_blocks == 0
