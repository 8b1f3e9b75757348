"""KVCacheManager with a sliding window (every layer slides): blocks wholly behind the window are
freed as a request advances, their entries become placeholders, and a prefix-cache hit holds only
the blocks its end can still see. Windows smaller than, equal to and not a multiple of the block."""

from __future__ import annotations

import pytest

from pdcluster.engine.kv_cache_manager import KVCacheManager
from pdcluster.engine.request import Request
from pdcluster.sampling_params import SamplingParams

BS = 4


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8))


def _step(kv: KVCacheManager, req: Request, num_tokens: int) -> None:
    """One scheduler step: allocate (with the prefix hit on admission), compute, publish."""
    hits, num_hit = kv.get_computed_blocks(req) if req.request_id not in kv.req_to_blocks else ([], 0)
    assert kv.allocate_slots(req, num_tokens, num_hit, hits) is not None
    req.num_computed_tokens += num_hit + num_tokens
    kv.cache_blocks(req, req.num_computed_tokens)


def _first_read(num_computed: int, window: int) -> int:
    """The first position a token after num_computed reads."""
    return max(0, num_computed - window + 1)


@pytest.mark.parametrize("window", [1, 3, 4, 6, 9])
def test_blocks_behind_the_window_are_freed_as_it_slides(window: int) -> None:
    kv = KVCacheManager(64, BS, True, 256, sliding_window=window)
    req = _req("a", list(range(50)))
    _step(kv, req, 13)  # a prefill chunk, then one token at a time
    peak = 0
    while req.num_computed_tokens < req.num_tokens:
        _step(kv, req, 1)
        blocks = kv.req_to_blocks["a"]
        c = req.num_computed_tokens - 1  # computed when this step's allocation ran
        first_held = _first_read(c, window) // BS
        assert all(b is kv.null_block for b in blocks[:first_held])
        assert all(b is not kv.null_block and b.ref_cnt == 1 for b in blocks[first_held:])
        used = kv.make_stats().num_used_blocks
        assert used == len(blocks) - first_held
        peak = max(peak, used)
    assert peak <= -(-window // BS) + 2  # bounded by the window, not by the 50 tokens
    kv.free(req)
    assert kv.make_stats().num_used_blocks == 0 and kv.num_free_blocks == 64


def test_no_window_frees_nothing() -> None:
    kv = KVCacheManager(64, BS, True, 256)
    req = _req("a", list(range(40)))
    for _ in range(40):
        _step(kv, req, 1)
    assert kv.make_stats().num_used_blocks == 10 and kv.null_block not in kv.req_to_blocks["a"]


def test_freed_blocks_stay_hittable_and_a_hit_holds_only_the_window() -> None:
    window = 6
    kv = KVCacheManager(64, BS, True, 256, sliding_window=window)
    a = _req("a", list(range(30)))
    _step(kv, a, 30)
    a_ids = kv.get_block_ids("a")
    b = _req("b", list(range(30)) + [99])
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 28  # 7 full blocks of the 30 shared tokens
    skip = _first_read(28, window) // BS  # position 28 reads keys from 23: block 5 on
    assert hits[:skip] == [kv.null_block] * skip
    assert [h.block_id for h in hits[skip:]] == a_ids[skip:7]
    before = kv.make_stats().num_used_blocks
    assert kv.allocate_slots(b, 3, num_hit, hits) is not None
    assert kv.make_stats().num_used_blocks == before + 1  # only one new block: the hits were held by a
    assert all(h.ref_cnt == 2 for h in hits[skip:])
    assert kv.make_stats().prefix_hits == 28


def test_a_hit_needs_only_the_window_blocks_cached() -> None:
    """The early blocks of a long prefix were evicted; the window's blocks at its end are cached:
    still a hit (with a full-attention model this is a miss from block 0)."""
    window = 5
    for w, want in ((window, 24), (None, 0)):
        kv = KVCacheManager(64, BS, True, 256, sliding_window=w)
        a = _req("a", list(range(26)))
        _step(kv, a, 26)
        ids = kv.get_block_ids("a")
        kv.free(a)
        kv.pool.evict_blocks(ids[:3])
        hits, num_hit = kv.get_computed_blocks(_req("b", list(range(26))))
        assert num_hit == want, w
        if w is not None:
            assert kv.allocate_slots(_req("b", list(range(26))), 2, num_hit, hits) is not None


def test_window_hit_stops_where_the_window_is_not_cached() -> None:
    window = 9
    kv = KVCacheManager(64, BS, True, 256, sliding_window=window)
    a = _req("a", list(range(40)))
    _step(kv, a, 40)
    ids = kv.get_block_ids("a")
    kv.free(a)
    kv.pool.evict_blocks([ids[7]])  # tokens 28..31
    hits, num_hit = kv.get_computed_blocks(_req("b", list(range(40))))
    # A hit ending at block k (at most 9: the last token is computed) needs blocks k-2 and k-1:
    # ends 8 and 9 need block 7; end 7 needs blocks 5 and 6.
    assert num_hit == 28 and all(h.block_hash is not None for h in hits[_first_read(28, window) // BS:])


def test_placeholders_are_never_published_freed_or_invalidated() -> None:
    window = 4
    kv = KVCacheManager(64, BS, True, 256, sliding_window=window)
    a = _req("a", list(range(21)))
    for _ in range(21):
        _step(kv, a, 1)
    real = [b for b in kv.req_to_blocks["a"] if b is not kv.null_block]
    kv.invalidate_blocks([0])  # a placeholder's id (0) is not a bad block of this request
    assert kv.num_cached_blocks["a"] == 5
    kv.invalidate_blocks([real[0].block_id])
    kv.cache_blocks(a, a.num_computed_tokens)  # republishing starts after the placeholders
    assert kv.null_block.block_hash is None and kv.null_block.ref_cnt == 0
    kv.free(a)
    assert kv.num_free_blocks == 64


def test_caching_disabled_still_frees_behind_the_window() -> None:
    kv = KVCacheManager(16, BS, False, 256, sliding_window=3)
    req = _req("a", list(range(120)))  # 30 blocks of tokens through a 16-block pool
    _step(kv, req, 8)
    while req.num_computed_tokens < req.num_tokens:
        _step(kv, req, 1)
    assert kv.make_stats().num_used_blocks <= 2
    with pytest.raises(ValueError, match="sliding_window"):
        KVCacheManager(16, BS, False, 256, sliding_window=0)
