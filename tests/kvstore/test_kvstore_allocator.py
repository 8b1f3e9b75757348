from __future__ import annotations

import random

import pytest

from pdcluster.kvstore.allocator import ExtentAllocator


def test_first_fit_split_and_coalesce() -> None:
    a = ExtentAllocator(4096, align=256)
    x, y, z = a.alloc(100), a.alloc(256), a.alloc(600)
    assert (x, y, z) == (0, 256, 512) and a.used == 256 + 256 + 768
    a.free(y, 256)
    assert a.alloc(200) == 256  # first fit reuses the hole
    a.free(256, 200)
    a.free(x, 100)
    a.free(z, 600)
    assert a.used == 0 and a.largest_free() == 4096  # fully coalesced


def test_double_free_and_bad_reserve_raise() -> None:
    a = ExtentAllocator(4096, align=256)
    off = a.alloc(256)
    a.free(off, 256)
    with pytest.raises(ValueError):
        a.free(off, 256)
    a.reserve(1024, 512)
    with pytest.raises(ValueError):
        a.reserve(1280, 256)  # inside the reserved extent
    with pytest.raises(ValueError):
        a.reserve(100, 10)  # misaligned


def test_random_workload_keeps_invariants() -> None:
    rng = random.Random(0)
    a = ExtentAllocator(1 << 20, align=64)
    live: dict[int, int] = {}
    for _ in range(3000):
        if live and rng.random() < 0.45:
            off = rng.choice(list(live))
            a.free(off, live.pop(off))
        else:
            size = rng.randint(1, 20000)
            off = a.alloc(size)
            if off is not None:
                assert all(off + a.round(size) <= o or o + a.round(n) <= off for o, n in live.items())
                live[off] = size
        assert a.used == sum(a.round(n) for n in live.values())
    for off, n in list(live.items()):
        a.free(off, n)
    assert a.largest_free() == a.capacity


def test_reserve_rebuilds_an_identical_layout() -> None:
    a, b = ExtentAllocator(1 << 16, 256), ExtentAllocator(1 << 16, 256)
    offs = [(a.alloc(n), n) for n in (300, 1000, 5000, 256)]
    for off, n in offs:
        b.reserve(off, n)
    assert a.used == b.used and a.alloc(777) == b.alloc(777)
