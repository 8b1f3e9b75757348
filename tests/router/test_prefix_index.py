"""PrefixIndex: contiguous prefix matching, updates, snapshots and the memory bound."""

from __future__ import annotations

import pytest

from pdcluster.router.prefix_index import PrefixIndex


def h(*ids: int) -> list[bytes]:
    return [f"h{i}".encode() for i in ids]


def test_match_counts_contiguous_prefix_only():
    idx = PrefixIndex()
    idx.add_blocks("A", h(0, 1, 2))
    idx.add_blocks("B", h(0, 2, 3))  # lacks h1: h2, h3 are unreachable for the engine
    idx.add_blocks("C", h(1, 2))  # lacks h0: nothing usable
    assert idx.match(h(0, 1, 2, 3)) == {"A": 3, "B": 1}
    assert idx.match(h(0, 1, 2)) == {"A": 3, "B": 1}
    assert idx.match(h(5)) == {}
    assert idx.match([]) == {}


def test_match_restricted_to_workers():
    idx = PrefixIndex()
    idx.add_blocks("A", h(0, 1))
    idx.add_blocks("B", h(0))
    assert idx.match(h(0, 1), workers=["B", "Z"]) == {"B": 1}


def test_remove_clear_and_remove_worker_keep_maps_consistent():
    idx = PrefixIndex()
    idx.add_blocks("A", h(0, 1, 2))
    idx.add_blocks("B", h(0, 1))
    idx.remove_blocks("A", h(1, 9))  # unknown hashes are ignored
    assert idx.match(h(0, 1, 2)) == {"A": 1, "B": 2}
    idx.remove_blocks("nobody", h(0))
    idx.clear_worker("B")
    assert idx.num_blocks("B") == 0 and "B" in idx.workers
    assert idx.match(h(0)) == {"A": 1}
    idx.remove_worker("A")
    assert idx.workers == ["B"]
    assert len(idx) == 0  # the reverse map holds nothing for forgotten blocks


def test_replace_worker_is_a_snapshot():
    idx = PrefixIndex()
    idx.add_blocks("A", h(0, 1, 2))
    idx.replace_worker("A", h(0, 5))
    assert sorted(idx.block_hashes("A")) == sorted(h(0, 5))
    assert not idx.contains("A", b"h1") and idx.contains("A", b"h5")
    assert len(idx) == 2


def test_memory_bound_evicts_least_recently_stored():
    idx = PrefixIndex(max_blocks_per_worker=3)
    idx.add_blocks("A", h(0, 1, 2))
    idx.add_blocks("A", h(0))  # refreshed: now the most recent
    idx.add_blocks("A", h(3))  # over the bound: h1 (oldest) goes
    assert sorted(idx.block_hashes("A")) == sorted(h(0, 2, 3))
    assert idx.num_evicted == 1
    assert idx.match(h(0, 1)) == {"A": 1}
    idx.add_blocks("B", h(10, 11, 12, 13, 14))
    assert idx.num_blocks("B") == 3 and idx.num_blocks("A") == 3  # bound is per worker
    assert len(idx) == 6


def test_invalid_bound():
    with pytest.raises(ValueError):
        PrefixIndex(max_blocks_per_worker=0)
