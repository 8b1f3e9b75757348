"""What the master reports to a beating node (KVHeartbeatResponse used_bytes/objects/object_bytes,
the node's /metrics): per-segment counts kept incrementally (MetadataStore._do_publish/_do_delete)
must equal a recount over every object, through two-phase and arena puts, removes, eviction, the
loss of one replica's node, and a restart that replays the op log (with and without a snapshot)."""

from __future__ import annotations

import secrets

import pytest

from pdcluster.kvstore.core import MasterCore
from pdcluster.kvstore.entities import MasterConfig, Status

SECRET = secrets.token_bytes(32)
CFG = MasterConfig(node_timeout_s=1e6, high_watermark=1.0, low_watermark=1.0)


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000

    def __call__(self) -> int:
        return self.t


def core(path, clock: Clock) -> MasterCore:
    c = MasterCore(CFG, SECRET, str(path), fsync="never", clock=clock)
    c.recover()
    return c


def recount(c: MasterCore, node_id: str) -> tuple[int, int]:
    """(published objects with a replica on the node, their bytes), the slow way."""
    objs = [o for o in c.store.objects.values()
            if o.state == "published" and any(p.seg.node_id == node_id for p in o.placements)]
    return len(objs), sum(o.size for o in objs)


def check(c: MasterCore) -> None:
    for node_id in c.store.nodes:
        used, objects, object_bytes = c.store.table.usage(node_id)
        assert (objects, object_bytes) == recount(c, node_id), node_id
        assert used == sum(s.alloc.used for s in c.store.nodes[node_id].segments.values())


@pytest.mark.parametrize("snapshot_midway", [False, True])
def test_usage_matches_a_recount_through_every_change(tmp_path, snapshot_midway: bool) -> None:
    clock = Clock()
    c = core(tmp_path, clock)
    s = c.store
    with c.lock:
        for i in range(3):
            s.mount(f"n{i}", "127.0.0.1", 9000 + i, "h", [(1, 1 << 20, f"pdcluster-{i}", 10 + i)], clock())
        for i in range(12):
            st, obj = s.put_start(f"k{i}", 1000 + 7 * i, 2, False, clock())
            assert st == Status.OK
            s.put_end(f"k{i}", obj.put_id, clock())
        s.put_start("pending", 5000, 1, False, clock())  # not published: not counted
        _, arena = s.arena_reserve(64 << 10, 2, clock())
        s.arena_commit(arena.arena_id, [("a0", 0, 1000), ("a1", 1024, 3000)], False, clock())
        s.remove("k3", clock())
        s.remove("a1", clock())
    check(c)
    assert sum(c.store.table.usage(n)[1] for n in c.store.nodes) == 2 * len(c.store.lru)  # two replicas each
    if snapshot_midway:
        c.snapshot()
    with c.lock:
        st, obj = s.put_start("after", 300, 3, False, clock())
        s.put_end("after", obj.put_id, clock())
        s.unmount("n1", None, clock())  # objects keep their other replica; n1's counts go with it
    check(c)
    want = {n: c.store.table.usage(n) for n in c.store.nodes}
    c.close()  # like a crash
    clock.t += 1000
    c2 = core(tmp_path, clock)
    assert {n: c2.store.table.usage(n)[1:] for n in c2.store.nodes} == {n: u[1:] for n, u in want.items()}
    check(c2)
    c2.close()


def test_eviction_keeps_usage_exact() -> None:
    cfg = MasterConfig(node_timeout_s=1e6, high_watermark=0.6, low_watermark=0.3)
    c = MasterCore(cfg, SECRET, None, clock=Clock())
    s = c.store
    with c.lock:
        s.mount("n0", "127.0.0.1", 9000, "h", [(1, 64 << 10, "pdcluster-e", 1)], c.clock())
        for i in range(40):
            st, obj = s.put_start(f"e{i}", 4096, 1, False, c.clock())
            if st == Status.OK:
                s.put_end(f"e{i}", obj.put_id, c.clock())
    assert s.counters["evictions"] > 0
    check(c)
