"""MetadataStore rules, driven with explicit times (no I/O, no sleeping)."""

from __future__ import annotations

from pdcluster.kvstore.entities import PENDING, PUBLISHED, MasterConfig, Status
from pdcluster.kvstore.metadata import MetadataStore

T0 = 1_000_000
CFG = MasterConfig(lease_ttl_s=5, put_timeout_s=30, grace_s=2, node_timeout_s=1e6, high_watermark=1.0,
                   low_watermark=1.0, align=256)  # eviction and node loss off unless a test turns them on
EVICTING = MasterConfig(lease_ttl_s=5, put_timeout_s=30, grace_s=2, node_timeout_s=1e6, high_watermark=0.9,
                        low_watermark=0.5)


def make(nodes: int = 1, seg: int = 4096, cfg: MasterConfig = CFG) -> MetadataStore:
    s = MetadataStore(cfg)
    for i in range(nodes):
        s.mount(f"n{i}", "127.0.0.1", 9000 + i, "host", [(1, seg, f"pdcluster-shm{i}", 7)], T0)
    return s


def put(s: MetadataStore, key: str, size: int = 256, now: int = T0, **kw) -> Status:
    st, obj = s.put_start(key, size, kw.pop("replicas", 1), kw.pop("pinned", False), now)
    if st != Status.OK:
        return st
    return s.put_end(key, obj.put_id, now)


def test_two_phase_put_is_invisible_until_end() -> None:
    s = make()
    st, obj = s.put_start("k", 1000, 1, False, T0)
    assert st == Status.OK and obj.state == PENDING
    assert not s.exists("k") and s.get("k", T0) is None
    assert s.put_end("k", "not-my-put", T0) == Status.NOT_FOUND
    assert s.put_end("k", obj.put_id, T0) == Status.OK and obj.state == PUBLISHED
    assert s.exists("k") and s.get("k", T0).size == 1000
    assert s.put_end("k", obj.put_id, T0) == Status.OK  # idempotent retry


def test_concurrent_puts_of_one_key_exactly_one_wins() -> None:
    s = make()
    st1, o1 = s.put_start("k", 256, 1, False, T0)
    st2, o2 = s.put_start("k", 256, 1, False, T0)
    assert (st1, st2) == (Status.OK, Status.IN_PROGRESS) and o2 is None
    assert s.put_revoke("k", "someone-else", T0) == Status.NOT_FOUND  # the loser cannot touch it
    s.put_end("k", o1.put_id, T0)
    assert put(s, "k") == Status.ALREADY_EXISTS


def test_revoke_and_timeout_reclaim_space_only_after_tokens_expire() -> None:
    s = make(seg=1024)
    st, obj = s.put_start("a", 1024, 1, False, T0)
    assert s.put_revoke("a", obj.put_id, T0) == Status.OK and not s.exists("a")
    # The write token lives until T0+30s (+2s grace): the extent is quarantined, not reusable.
    assert s.put_start("b", 1024, 1, False, T0 + 1000)[0] == Status.NO_SPACE
    s.tick(T0 + 32_001)
    st, obj = s.put_start("b", 1024, 1, False, T0 + 32_001)
    assert st == Status.OK
    s.tick(T0 + 32_001 + 30_001)  # abandoned: never ended
    assert "b" not in s.objects and s.counters["puts_timed_out"] == 1


def test_replicas_on_distinct_nodes_best_effort() -> None:
    s = make(nodes=3)
    st, obj = s.put_start("k", 256, 3, False, T0)
    assert len({p.seg.node_id for p in obj.placements}) == 3
    st, obj = s.put_start("k2", 256, 5, False, T0)  # only 3 nodes: best effort
    assert len(obj.placements) == 3
    one = make(nodes=1, seg=1 << 20)
    st, obj = one.put_start("k", 256, 2, False, T0)
    assert st == Status.OK and len(obj.placements) == 1  # never two replicas on one node


def test_eviction_is_lru_and_skips_pinned_leased_and_pending() -> None:
    s = make(seg=10 * 256, cfg=EVICTING)  # 10 slots; high 90% -> evict above 9 used, down to 5
    put(s, "pinned", pinned=True)
    for k in ("a", "b", "c", "d", "e"):
        put(s, k)
    s.get("a", T0 + 10)  # a is now most recently used, and leased until T0+5010
    pending_st, _ = s.put_start("pending", 256, 1, False, T0)
    t = T0 + 100
    put(s, "f", now=t)
    put(s, "g", now=t)
    put(s, "h", now=t)  # 10 used > 9: evict down to 5
    evicted = {k for k in ("a", "b", "c", "d", "e", "f", "g", "h") if not s.exists(k)}
    assert evicted == {"b", "c", "d", "e", "f"}  # oldest first; "a" is leased, "pinned" pinned
    assert s.exists("pinned") and s.exists("a") and "pending" in s.objects
    assert s.counters["evictions"] == 5


def test_lease_blocks_reuse_until_expiry() -> None:
    s = make(seg=512, cfg=MasterConfig(lease_ttl_s=5, put_timeout_s=1, grace_s=2, high_watermark=1.0,
                                       low_watermark=1.0))
    put(s, "x", size=512)
    obj = s.get("x", T0)  # lease until T0+5000
    assert s.remove("x", T0 + 1) == Status.OK and not s.exists("x")  # hidden at once
    assert s.put_start("y", 512, 1, False, T0 + 10)[0] == Status.NO_SPACE  # bytes still leased
    s.tick(T0 + 6999)
    assert s.put_start("y", 512, 1, False, T0 + 6999)[0] == Status.NO_SPACE  # ... plus the grace
    s.tick(T0 + 5000 + 2000 + 1)
    assert s.put_start("y", 512, 1, False, T0 + 7001)[0] == Status.OK
    assert obj.lease_until_ms == T0 + 5000


def test_leased_objects_are_not_evicted_for_space() -> None:
    s = make(seg=512, cfg=MasterConfig(put_timeout_s=1, high_watermark=1.0, low_watermark=1.0, grace_s=0))
    put(s, "x", size=512)
    s.get("x", T0)
    assert s.put_start("y", 512, 1, False, T0 + 10)[0] == Status.NO_SPACE  # x is leased
    st, _ = s.put_start("y", 512, 1, False, T0 + 5001)
    assert st == Status.OK and not s.exists("x")  # lease over: x evicted to make room


def test_node_loss_drops_its_replicas_and_partial_puts() -> None:
    s = make(nodes=2, cfg=MasterConfig(node_timeout_s=10))
    st, both = s.put_start("both", 256, 2, False, T0)
    s.put_end("both", both.put_id, T0)
    s.put_start("pending", 256, 2, False, T0)
    st, one = s.put_start("one", 256, 1, False, T0)
    s.put_end("one", one.put_id, T0)
    lost = one.placements[0].seg.node_id
    keep = "n1" if lost == "n0" else "n0"
    s.heartbeat(keep, [(1, 7)], T0 + 9000)
    s.tick(T0 + 10_001)  # `lost` missed its heartbeats
    assert lost not in s.nodes and keep in s.nodes
    assert s.exists("both") and [p.seg.node_id for p in s.objects["both"].placements] == [keep]
    assert not s.exists("one") and "pending" not in s.objects
    st = s.stats()
    assert (st["objects"], st["object_bytes"], st["pending_puts"], st["nodes"]) == (1, 256, 0, 1)


def test_remount_with_new_incarnation_drops_old_data() -> None:
    s = make()
    put(s, "k")
    assert s.heartbeat("n0", [(1, 7)], T0) == Status.OK
    assert s.heartbeat("n0", [(1, 8)], T0) == Status.UNKNOWN_NODE
    s.mount("n0", "127.0.0.1", 9000, "host", [(1, 4096, "pdcluster-new", 8)], T0)
    assert not s.exists("k") and s.used() == 0


def test_invalid_requests() -> None:
    s = make()
    assert s.put_start("", 10, 1, False, T0)[0] == Status.INVALID
    assert s.put_start("k", 0, 1, False, T0)[0] == Status.INVALID
    assert s.put_start("x" * 2000, 10, 1, False, T0)[0] == Status.INVALID
    assert s.put_start("big", 1 << 20, 1, False, T0)[0] == Status.NO_SPACE
    assert s.remove("missing", T0) == Status.NOT_FOUND
