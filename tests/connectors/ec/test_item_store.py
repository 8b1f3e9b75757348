"""ItemStore: the producer's item states, leases and bounds (pure Python, a fake clock: no sleeps)."""

from __future__ import annotations

import pytest

from pdcluster.connectors.ec.item_store import ItemStore, StoreFull
from pdcluster.engine.ec_connector import ECItemState

H = [f"{i:064x}" for i in range(16)]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _save(store: ItemStore, h: str, nbytes: int = 100) -> int:
    off = store.allocate(h, nbytes)
    assert off is not None
    store.commit(h, (nbytes // 4, 1), "float32", b"d" * 32)
    return off


def test_states_absent_pending_ready_pinned_evicted() -> None:
    clock = Clock()
    store = ItemStore(1 << 12, 8, lease_s=10, clock=clock)
    assert store.state(H[0]) is ECItemState.ABSENT
    store.reserve(H[0])
    assert store.state(H[0]) is ECItemState.PENDING  # the tower is running: not servable, not missing
    assert store.lease(H[0]) is None  # a pending item is never announced
    _save(store, H[0])
    assert store.state(H[0]) is ECItemState.READY
    lease = store.lease(H[0])
    assert lease is not None and store.state(H[0]) is ECItemState.PINNED
    assert store.release(lease.lease_id, H[0]) is True
    assert store.state(H[0]) is ECItemState.READY
    assert store.release(lease.lease_id, H[0]) is False  # once
    assert store.drop(H[0]) and store.state(H[0]) is ECItemState.EVICTED


def test_lease_expiry_frees_the_item_for_eviction() -> None:
    clock = Clock()
    store = ItemStore(256, 8, lease_s=10, clock=clock)
    _save(store, H[0], 200)
    lease = store.lease(H[0])
    assert lease is not None
    with pytest.raises(StoreFull):  # the only item is pinned: no room, and it is not evicted
        store.allocate(H[1], 200)
    assert store.state(H[0]) is ECItemState.PINNED
    clock.t += 10.5
    assert store.live_lease(lease.lease_id) is None
    assert store.expire() == 1
    assert store.state(H[0]) is ECItemState.READY
    assert store.allocate(H[1], 200) == 0  # H[0] evicted (LRU, unleased) and its space reused
    assert store.state(H[0]) is ECItemState.EVICTED
    assert store.release(lease.lease_id, H[0]) is False


def test_pending_reservation_expires() -> None:
    clock = Clock()
    store = ItemStore(1 << 12, 8, lease_s=5, clock=clock)
    store.reserve(H[2])
    clock.t += 6
    store.expire()
    assert store.state(H[2]) is ECItemState.ABSENT  # a failed encode does not leave NOT_READY forever


def test_lru_eviction_skips_leased_items_and_space_coalesces() -> None:
    store = ItemStore(4 * 128, 16, lease_s=10, clock=Clock())
    offs = [_save(store, H[i], 128) for i in range(4)]
    assert offs == [0, 128, 256, 384]
    store.lease(H[0])  # pinned although least recently used
    _save(store, H[4], 128)  # evicts H[1], the LRU unleased item
    assert store.state(H[1]) is ECItemState.EVICTED and store.state(H[0]) is ECItemState.PINNED
    assert store.drop(H[2]) and store.drop(H[3])
    # H[2] and H[3] were neighbours: their holes coalesced into one that fits 256 bytes
    assert store.allocate(H[5], 256) == 256


def test_bounds_max_items_and_too_large() -> None:
    store = ItemStore(1 << 10, 2, lease_s=10, clock=Clock())
    with pytest.raises(StoreFull, match="larger than max_bytes"):
        store.allocate(H[0], 2 << 10)
    _save(store, H[0])
    _save(store, H[1])
    store.lease(H[0])
    store.lease(H[1])
    with pytest.raises(StoreFull, match="max_items"):
        store.allocate(H[2], 10)
    store.reserve(H[3])  # full: a reservation is simply not made
    assert store.state(H[3]) is ECItemState.ABSENT
    assert store.stats()["store_items"] == 2


def test_grant_release_checks_owner() -> None:
    store = ItemStore(1 << 10, 4, lease_s=10, clock=Clock())
    _save(store, H[0])
    grant = store.lease(H[0], owner="prefill")
    assert grant is not None
    assert store.release(grant.lease_id, H[0], owner="other") is False  # someone else's grant
    assert store.release(grant.lease_id, H[1], owner="prefill") is False  # another item
    assert store.release(grant.lease_id, H[0], owner="prefill") is True
