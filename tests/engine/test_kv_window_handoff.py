"""KV manager pieces the windowed P2P hand-off relies on: a new request whose tokens a connector
loads gets placeholders (not blocks) wholly behind the loaded point, its local hits there are not
held; a failed load that cuts a windowed request back where its window would read placeholders
resumes from 0, and allocate_slots then gives it real blocks again (never a placeholder to write)."""

from __future__ import annotations

from pdcluster.engine.kv_cache_manager import KVCacheManager
from pdcluster.engine.kv_window import first_needed_block
from pdcluster.engine.request import Request
from pdcluster.sampling_params import SamplingParams

BS, W = 3, 5


def _req(rid: str, n: int) -> Request:
    return Request(rid, list(range(10, 10 + n)), SamplingParams(max_tokens=4))


def test_external_tokens_behind_the_window_get_placeholders() -> None:
    kv = KVCacheManager(20, BS, True, 128, sliding_window=W)
    # A first request publishes 4 blocks a second one can hit.
    a = _req("a", 13)
    assert kv.allocate_slots(a, 13) is not None
    kv.cache_blocks(a, 13)
    kv.free(a)
    b = _req("b", 26)
    hits, num_local = kv.get_computed_blocks(b)
    assert num_local == 12
    free_before = kv.num_free_blocks
    ids = kv.allocate_slots(b, 0, num_local, hits, 13)  # a connector loads tokens [12, 25)
    lead = first_needed_block(25, W, BS)  # 7: blocks 0..6 are never read again
    assert ids is not None and ids[:lead] == [0] * lead and 0 not in ids[lead:]
    assert len(ids) == 9 and kv.num_skipped_blocks["b"] == lead
    assert free_before - kv.num_free_blocks == 9 - lead  # the hits (blocks 0..3) are not held
    b.num_computed_tokens = 25
    kv.cache_blocks(b, 25)  # publishes only real blocks
    assert all(blk is kv.null_block or blk.block_hash is not None for blk in kv.req_to_blocks["b"][:8])


def test_a_cut_into_the_placeholders_recomputes_from_zero_with_real_blocks() -> None:
    kv = KVCacheManager(20, BS, False, 128, sliding_window=W)
    r = _req("r", 26)
    assert kv.allocate_slots(r, 0, 0, [], 25) is not None
    skipped = kv.num_skipped_blocks["r"]
    assert skipped == first_needed_block(25, W, BS) == 7
    assert kv.recompute_point("r", 25) == 25  # reads from 25-5+1 = 21: block 7, real
    assert kv.recompute_point("r", 24) == 0  # would read block 6: a placeholder
    assert kv.recompute_point("r", 0) == 0
    r.num_computed_tokens = 0
    ids = kv.allocate_slots(r, 6)
    assert ids is not None and kv.num_skipped_blocks["r"] == 0
    assert all(b is not kv.null_block for b in kv.req_to_blocks["r"])
    kv.free(r)
    assert kv.num_free_blocks == 20
