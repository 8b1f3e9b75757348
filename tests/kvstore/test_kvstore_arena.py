"""Write-arena rules in MetadataStore, driven with explicit times (no I/O, no sleeping)."""

from __future__ import annotations

from pdcluster.kvstore.entities import PUBLISHED, MasterConfig, Status
from pdcluster.kvstore.metadata import MetadataStore

T0 = 1_000_000
TTL = 30_000  # put_timeout_s: the arena's fixed write expiry is T0 + TTL
GRACE = 2_000
CFG = MasterConfig(lease_ttl_s=5, put_timeout_s=30, grace_s=2, node_timeout_s=1e6, high_watermark=1.0,
                   low_watermark=1.0, align=256, arena_max_fraction=1.0)  # no eviction, node loss or arena cap


def make(nodes: int = 1, seg: int = 4096, cfg: MasterConfig = CFG) -> MetadataStore:
    s = MetadataStore(cfg)
    for i in range(nodes):
        s.mount(f"n{i}", "127.0.0.1", 9000 + i, "host", [(1, seg, f"pdcluster-shm{i}", 7)], T0)
    return s


def ranges(s: MetadataStore, key: str) -> list[tuple[str, int, int]]:
    return [(p.seg.node_id, p.offset, p.alloc_size) for p in s.objects[key].placements]


def test_lifecycle_reserve_commit_several_batches_release() -> None:
    s = make(nodes=2, seg=8192)
    st, arena = s.arena_reserve(4096, 2, T0)
    assert st == Status.OK and arena.size == 4096 and s.used() == 2 * 4096
    bases = {p.seg.node_id: p.offset for p in arena.placements}
    assert sorted(bases) == ["n0", "n1"]  # one extent per replica, on distinct nodes
    assert s.arena_commit(arena.arena_id, [("a", 0, 100), ("b", 256, 600)], False, T0) == (Status.OK, [Status.OK] * 2)
    assert s.arena_commit(arena.arena_id, [("c", 1024, 256)], True, T0 + 5) == (Status.OK, [Status.OK])
    assert all(s.exists(k) for k in "abc") and s.objects["c"].pinned
    # Same relative offset in every replica; sizes rounded to the alignment.
    assert sorted(ranges(s, "b")) == [(n, bases[n] + 256, 768) for n in ("n0", "n1")]
    assert s.get("b", T0).size == 600 and s.objects["b"].write_expiry_ms == T0 + TTL
    assert s.stats()["object_bytes"] == 100 + 600 + 256 and s.stats()["arenas"] == 1
    assert s.arena_release(arena.arena_id, T0 + 10) == Status.OK
    assert s.arena_release(arena.arena_id, T0 + 10) == Status.NOT_FOUND
    assert s.arena_commit(arena.arena_id, [("d", 2048, 10)], False, T0 + 10)[0] == Status.NOT_FOUND
    # The untaken rest (4096 - 256 - 768 - 256 per replica) waits out the arena's tokens.
    rest = 2 * (4096 - 1280)
    assert s.quarantined_bytes == rest and s.used() == 2 * 4096
    s.tick(T0 + TTL + GRACE - 1)
    assert s.quarantined_bytes == rest
    s.tick(T0 + TTL + GRACE)
    assert s.quarantined_bytes == 0 and s.used() == 2 * 1280  # only the three objects are left


def test_two_commits_of_one_key_exactly_one_wins() -> None:
    s = make(seg=8192)
    _, a1 = s.arena_reserve(2048, 1, T0)
    _, a2 = s.arena_reserve(2048, 1, T0)
    assert s.arena_commit(a1.arena_id, [("k", 0, 300)], False, T0) == (Status.OK, [Status.OK])
    assert s.arena_commit(a2.arena_id, [("k", 0, 300)], False, T0) == (Status.OK, [Status.ALREADY_EXISTS])
    assert s.objects["k"].placements[0].offset == a1.placements[0].offset  # the first one's bytes
    st, pending = s.put_start("p", 100, 1, False, T0)  # a two-phase put of "p" is in flight
    assert st == Status.OK
    assert s.arena_commit(a2.arena_id, [("p", 0, 100)], False, T0)[1] == [Status.IN_PROGRESS]
    assert s.put_start("k", 100, 1, False, T0)[0] == Status.ALREADY_EXISTS
    # A rejected item's range is still the arena's: another key may take it.
    assert s.arena_commit(a2.arena_id, [("q", 0, 300)], False, T0)[1] == [Status.OK]


def test_invalid_items_are_rejected_one_by_one() -> None:
    s = make(seg=8192)
    _, a = s.arena_reserve(2048, 1, T0)
    assert s.arena_commit(a.arena_id, [("first", 512, 256)], False, T0)[1] == [Status.OK]
    items = [
        ("misaligned", 100, 10),
        ("past-end", 1792, 300),      # 1792 + 512 > 2048
        ("negative", -256, 10),
        ("overlaps-first", 256, 300),  # [256, 768) meets [512, 768)
        ("", 1024, 10),                # empty key
        ("x" * 2000, 1024, 10),        # key too long
        ("empty", 1024, 0),
        ("ok", 1024, 200),
        ("overlaps-ok", 1024, 10),     # the item just before it in this same batch took 1024
        ("ok2", 0, 512),
    ]
    _, statuses = s.arena_commit(a.arena_id, items, False, T0)
    assert statuses == [Status.INVALID] * 7 + [Status.OK, Status.INVALID, Status.OK]
    assert sorted(k for k in s.objects) == ["first", "ok", "ok2"]
    assert a.taken() == [(0, 512), (512, 768), (1024, 1280)]


def test_expired_arena_refuses_commits_and_frees_only_after_expiry_plus_grace() -> None:
    s = make(seg=4096)
    _, a = s.arena_reserve(4096, 1, T0)
    assert s.arena_commit(a.arena_id, [("k", 0, 256)], False, T0 + TTL)[1] == [Status.OK]  # last moment
    assert s.arena_commit(a.arena_id, [("late", 256, 256)], False, T0 + TTL + 1) == (
        Status.NOT_FOUND, [Status.NOT_FOUND])
    s.tick(T0 + TTL + 1)  # reclaimed: the rest is quarantined, not free
    assert not s.arenas and s.counters["arenas_expired"] == 1 and "late" not in s.objects
    assert s.put_start("big", 2048, 1, False, T0 + TTL + 1)[0] == Status.NO_SPACE
    s.tick(T0 + TTL + GRACE - 1)
    assert s.put_start("big", 2048, 1, False, T0 + TTL + GRACE - 1)[0] == Status.NO_SPACE
    s.tick(T0 + TTL + GRACE)
    assert s.put_start("big", 2048, 1, False, T0 + TTL + GRACE)[0] == Status.OK


def test_removed_arena_object_waits_for_the_arena_tokens() -> None:
    s = make(seg=1024)
    _, a = s.arena_reserve(1024, 1, T0)
    s.arena_commit(a.arena_id, [("k", 0, 1024)], False, T0)
    s.arena_release(a.arena_id, T0)  # nothing left to release: k took all of it
    assert s.remove("k", T0 + 1) == Status.OK
    s.tick(T0 + 5_000 + GRACE + 1)  # past k's (unused) read lease, but the arena's token is live
    assert s.put_start("x", 1024, 1, False, T0 + 7_001)[0] == Status.NO_SPACE
    s.tick(T0 + TTL + GRACE)
    assert s.put_start("x", 1024, 1, False, T0 + TTL + GRACE)[0] == Status.OK


def test_eviction_never_touches_arenas() -> None:
    cfg = MasterConfig(lease_ttl_s=5, put_timeout_s=30, grace_s=2, node_timeout_s=1e6, high_watermark=0.9,
                       low_watermark=0.5, arena_max_fraction=1.0)
    s = make(seg=10 * 256, cfg=cfg)
    _, a = s.arena_reserve(6 * 256, 1, T0)  # 6 of 10 slots
    s.arena_commit(a.arena_id, [("in-arena", 0, 256)], False, T0)
    for k in ("x", "y", "z"):
        st, obj = s.put_start(k, 256, 1, False, T0)
        s.put_end(k, obj.put_id, T0 + 1)  # 9 used: at the watermark, not above
    st, obj = s.put_start("w", 256, 1, False, T0 + 2)
    s.put_end("w", obj.put_id, T0 + 2)  # 10 > 9: evict down to 5 -- only objects can go
    assert a.arena_id in s.arenas and s.arenas[a.arena_id].free_pieces() == [(256, 6 * 256)]
    # Every object went (the arena's own 5 free slots alone exceed the low watermark), the arena stayed.
    assert s.counters["evictions"] == 5 and not s.lru
    assert s.used() - s.quarantined_bytes == 5 * 256
    assert s.arena_commit(a.arena_id, [("later", 256, 256)], False, T0 + 3)[1] == [Status.OK]


def test_node_loss_drops_its_arenas_and_keeps_committed_objects_on_survivors() -> None:
    s = make(nodes=2, seg=8192, cfg=MasterConfig(put_timeout_s=30, grace_s=2, node_timeout_s=10, arena_max_fraction=1.0))
    _, a = s.arena_reserve(4096, 2, T0)
    s.arena_commit(a.arena_id, [("k", 0, 1000)], False, T0)
    _, only0 = s.arena_reserve(1024, 1, T0)
    lost = only0.placements[0].seg.node_id
    keep = "n1" if lost == "n0" else "n0"
    s.heartbeat(keep, [(1, 7)], T0 + 9000)
    s.tick(T0 + 10_001)  # `lost` missed its heartbeats
    assert not s.arenas and s.counters["arenas_lost"] == 2
    assert s.arena_commit(a.arena_id, [("k2", 1024, 10)], False, T0 + 10_001)[0] == Status.NOT_FOUND
    assert s.objects["k"].state == PUBLISHED and [p.seg.node_id for p in s.objects["k"].placements] == [keep]
    # The surviving replica's untaken rest waits out the arena's tokens.
    assert s.quarantined_bytes == 4096 - 1024
    s.heartbeat(keep, [(1, 7)], T0 + TTL + GRACE)
    s.tick(T0 + TTL + GRACE)
    assert s.used() == 1024


def test_reserve_rejects_bad_sizes_and_reports_no_space() -> None:
    s = make(seg=4096)
    assert s.arena_reserve(0, 1, T0) == (Status.INVALID, None)
    assert s.arena_reserve(CFG.max_object_size + 1, 1, T0) == (Status.INVALID, None)
    st, a = s.arena_reserve(8192, 1, T0)
    assert st == Status.OK and a.size == 4096  # capped at the segment (arena_max_fraction=1 here)
    assert s.arena_reserve(256, 1, T0) == (Status.NO_SPACE, None)
    assert s.arena_commit("no-such-arena", [("k", 0, 1)], False, T0) == (Status.NOT_FOUND, [Status.NOT_FOUND])


def test_arenas_are_capped_and_never_evict() -> None:
    cfg = MasterConfig(put_timeout_s=30, grace_s=2, node_timeout_s=1e6, high_watermark=1.0, low_watermark=1.0,
                       arena_max_fraction=0.25)
    s = make(seg=16 * 256, cfg=cfg)
    st, a = s.arena_reserve(1 << 20, 1, T0)
    assert st == Status.OK and a.size == 4 * 256  # a quarter of the segment, not the 1 MiB asked for
    for k in range(12):  # fill the rest with evictable objects
        st, obj = s.put_start(f"o{k}", 256, 1, False, T0)
        s.put_end(f"o{k}", obj.put_id, T0)
    assert s.arena_reserve(256, 1, T0 + 1) == (Status.NO_SPACE, None)
    assert len(s.lru) == 12 and s.counters["evictions"] == 0  # nothing was pushed out for it
    s.put_start("p", 256, 1, False, T0 + 1)  # a put does evict (its bytes come back after the grace)
    assert s.counters["evictions"] > 0 and a.arena_id in s.arenas
