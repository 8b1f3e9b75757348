"""Op log + snapshot: a restarted master comes back with every published object."""

from __future__ import annotations

import os
import secrets
import struct

import pytest

from pdcluster.kvstore.core import MasterCore
from pdcluster.kvstore.entities import MasterConfig, Status
from pdcluster.kvstore.oplog import OpLog, OpLogCorrupt

SECRET = secrets.token_bytes(32)
CFG = MasterConfig(node_timeout_s=1e6, high_watermark=1.0, low_watermark=1.0)


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000

    def __call__(self) -> int:
        return self.t


def core(path: str, clock: Clock, fsync: str = "never") -> MasterCore:
    c = MasterCore(CFG, SECRET, str(path), fsync=fsync, clock=clock)
    c.recover()
    return c


def fill(c: MasterCore, clock: Clock) -> dict[str, tuple]:
    s = c.store
    with c.lock:
        s.mount("n0", "127.0.0.1", 9000, "h", [(1, 1 << 20, "pdcluster-a", 11)], clock())
        s.mount("n1", "127.0.0.1", 9001, "h", [(1, 1 << 20, "pdcluster-b", 12)], clock())
        for i in range(20):
            st, obj = s.put_start(f"k{i}", 1000 + i, 2, i == 3, clock())
            s.put_end(f"k{i}", obj.put_id, clock())
        s.remove("k5", clock())
        s.put_start("pending", 5000, 1, False, clock())
        return {k: (o.size, o.pinned, [(p.seg.node_id, p.offset) for p in o.placements])
                for k, o in s.objects.items() if o.state == "published"}


def published(c: MasterCore) -> dict[str, tuple]:
    return {k: (o.size, o.pinned, [(p.seg.node_id, p.offset) for p in o.placements])
            for k, o in c.store.objects.items() if o.state == "published"}


@pytest.mark.parametrize("snapshot_midway", [False, True])
def test_restart_replays_everything_published(tmp_path, snapshot_midway: bool) -> None:
    clock = Clock()
    c = core(tmp_path, clock)
    if snapshot_midway:
        fill(c, clock)
        c.snapshot()
        with c.lock:
            st, obj = c.store.put_start("after", 300, 1, False, clock())
            c.store.put_end("after", obj.put_id, clock())
        want = published(c)
    else:
        want = fill(c, clock)
    used = c.store.used()
    c.close()  # like a crash: nothing else is flushed or snapshotted
    clock.t += 1000
    c2 = core(tmp_path, clock)
    assert published(c2) == want and "k5" not in c2.store.objects and "pending" not in c2.store.objects
    assert c2.store.used() == used  # the abandoned put's extent is quarantined, not lost or reused
    # Tokens issued before the crash may be live: everything counts as leased for a while.
    assert all(o.lease_until_ms >= clock() + 4000 for o in c2.store.objects.values())
    with c2.lock:  # new allocations never overlap recovered objects
        st, obj = c2.store.put_start("new", 4000, 1, False, clock())
        taken = {(n, off) for v in want.values() for n, off in v[2]}
        assert st == Status.OK and (obj.placements[0].seg.node_id, obj.placements[0].offset) not in taken
    c2.close()
    c3 = core(tmp_path, clock)  # recovering a recovered store changes nothing
    assert {k: v for k, v in published(c3).items()} == want
    c3.close()


def test_torn_last_record_is_ignored(tmp_path) -> None:
    clock = Clock()
    c = core(tmp_path, clock)
    want = fill(c, clock)
    c.close()
    log = max(f for f in os.listdir(tmp_path) if f.startswith("oplog."))
    path = os.path.join(tmp_path, log)
    size = os.path.getsize(path)
    with open(path, "ab") as f:
        f.write(struct.pack("!II", 500, 0) + b"\x81\xa2op")  # a record cut short by a crash
    raw = OpLog(str(tmp_path))
    _, records = raw.recover()
    raw.close()
    assert records and os.path.getsize(path) == size  # truncated back to the last whole record
    c2 = core(tmp_path, clock)
    assert published(c2) == want
    c2.close()


def test_corruption_in_the_middle_raises(tmp_path) -> None:
    clock = Clock()
    c = core(tmp_path, clock)
    fill(c, clock)
    c.close()
    log = max(f for f in os.listdir(tmp_path) if f.startswith("oplog."))
    path = os.path.join(tmp_path, log)
    data = bytearray(open(path, "rb").read())
    data[20] ^= 0xFF  # inside the first record: later records exist, so this is not a torn tail
    open(path, "wb").write(bytes(data))
    with pytest.raises(OpLogCorrupt):
        OpLog(str(tmp_path)).recover()


def test_corrupt_snapshot_raises(tmp_path) -> None:
    clock = Clock()
    c = core(tmp_path, clock)
    fill(c, clock)
    c.snapshot()
    c.close()
    snap = os.path.join(tmp_path, "snapshot")
    data = bytearray(open(snap, "rb").read())
    data[-3] ^= 0x10
    open(snap, "wb").write(bytes(data))
    with pytest.raises(OpLogCorrupt):
        OpLog(str(tmp_path)).recover()


def test_snapshot_drops_old_logs_and_fsync_always(tmp_path) -> None:
    clock = Clock()
    c = core(tmp_path, clock, fsync="always")
    fill(c, clock)
    c.snapshot()
    logs = [f for f in os.listdir(tmp_path) if f.startswith("oplog.")]
    assert len(logs) == 1 and os.path.getsize(os.path.join(tmp_path, logs[0])) == 0
    c.close()


@pytest.mark.parametrize("snapshot_midway", [False, True])
def test_restart_replays_arenas_and_their_objects(tmp_path, snapshot_midway: bool) -> None:
    clock = Clock()
    c = core(tmp_path, clock)
    s = c.store
    with c.lock:
        s.mount("n0", "127.0.0.1", 9000, "h", [(1, 1 << 20, "pdcluster-a", 11)], clock())
        s.mount("n1", "127.0.0.1", 9001, "h", [(1, 1 << 20, "pdcluster-b", 12)], clock())
        _, a = s.arena_reserve(64 << 10, 2, clock())
        s.arena_commit(a.arena_id, [("a0", 0, 1000), ("a1", 1024, 3000)], False, clock())
        _, b = s.arena_reserve(8192, 1, clock())
        s.arena_commit(b.arena_id, [("b0", 0, 100)], True, clock())
        s.arena_release(b.arena_id, clock())
    if snapshot_midway:
        c.snapshot()
    with c.lock:
        assert s.arena_commit(a.arena_id, [("a2", 8192, 500)], False, clock())[1] == [Status.OK]
        s.remove("a1", clock())
    want, used, taken = published(c), s.used(), a.taken()
    c.close()  # like a crash
    clock.t += 1000
    c2 = core(tmp_path, clock)
    s2 = c2.store
    assert published(c2) == want and s2.used() == used and s2.quarantined_bytes == s.quarantined_bytes
    assert list(s2.arenas) == [a.arena_id]  # the released one stays released
    a2 = s2.arenas[a.arena_id]
    assert a2.taken() == taken and a2.write_expiry_ms == a.write_expiry_ms and a2.size == a.size
    with c2.lock:  # the arena keeps taking commits (its client's tokens are still live) ...
        assert s2.arena_commit(a.arena_id, [("a3", 16384, 10), ("x", 0, 10)], False, clock()) == (
            Status.OK, [Status.OK, Status.INVALID])
        st, obj = s2.put_start("new", 4000, 1, False, clock())  # ... and nothing else gets its space
        p = obj.placements[0]
        arena_ext = {q.seg.node_id: (q.offset, q.offset + q.alloc_size) for q in a2.placements}
        lo, hi = arena_ext[p.seg.node_id]
        assert st == Status.OK and (p.offset >= hi or p.offset + p.alloc_size <= lo)
        s2.put_end("new", obj.put_id, clock())
    clock.t = a.write_expiry_ms + 1
    c2.tick()
    assert not s2.arenas and s2.quarantined_bytes > 0  # expired: the rest waits out the grace
    clock.t = a.write_expiry_ms + 2000
    c2.tick()
    objects_bytes = sum(p.alloc_size for o in s2.objects.values() for p in o.placements)
    assert s2.quarantined_bytes == 0 and s2.used() == objects_bytes
    c2.close()
    c3 = core(tmp_path, clock)  # the expiry was logged too
    assert not c3.store.arenas and c3.store.used() == objects_bytes and "a3" in published(c3)
    c3.close()
