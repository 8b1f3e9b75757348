"""Crashes: master restart (op log, snapshot), storage node killed mid-put, eviction under pressure."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from pdcluster.kvstore import KVStoreClient, Status
from pdcluster.transfer import TransferError


def blob(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def wait_until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)


def test_master_killed_and_restarted_keeps_every_object(procs) -> None:
    port = str(procs.free_port())
    data_dir = os.path.join(procs.tmp, "master")
    args = ("--port", port, "--data-dir", data_dir, "--snapshot-interval-s", "0.3")
    master, addr = procs.master(*args)
    procs.node(addr, "n0")
    procs.node(addr, "n1")
    objs = {f"obj/{i}": blob(10_000 + 4096 * i, i) for i in range(16)}
    keys = list(objs)
    with KVStoreClient(addr, use_shm=False) as c:
        assert c.batch_put(keys[:8], [objs[k] for k in keys[:8]], replica_num=2) == [Status.OK] * 8
        snap = os.path.join(data_dir, "snapshot")
        first = os.path.getmtime(snap)
        wait_until(lambda: os.path.getmtime(snap) > first)  # a periodic snapshot now holds the first half
        assert c.batch_put(keys[8:], [objs[k] for k in keys[8:]]) == [Status.OK] * 8  # only in the log
        c.remove("obj/3")
        started = c.start_puts(["half-done"], [1000])  # never ended: must not come back
        assert started[0][0] == Status.OK
    procs.kill(master)  # SIGKILL: no shutdown path runs
    procs.master(*args)
    with KVStoreClient(addr, use_shm=False) as c:
        expect = [k for k in keys if k != "obj/3"]
        assert c.batch_exists(expect + ["obj/3", "half-done"]) == [True] * len(expect) + [False, False]
        dests = [np.zeros(objs[k].nbytes, dtype=np.uint8) for k in expect]
        assert c.batch_get(expect, dests) == [objs[k].nbytes for k in expect]
        assert all(np.array_equal(d, objs[k]) for k, d in zip(expect, dests, strict=True))
        time.sleep(1.0)  # nodes keep heartbeating the new master: nothing is declared lost
        assert c.stats()["nodes"] == 2
        assert c.put("after-restart", b"y" * 4096) == Status.OK


@pytest.mark.parametrize("client_revokes", [True, False])
def test_storage_node_killed_mid_put_leaves_no_partial_object(procs, client_revokes: bool) -> None:
    _, addr = procs.master("--port", "0", "--node-timeout-s", "1")
    node = procs.node(addr, "victim")
    with KVStoreClient(addr, use_shm=False) as c:
        assert c.put("before", b"b" * 1000) == Status.OK
        (st, pending), = c.start_puts(["mid"], [4 << 20])
        assert st == Status.OK and not c.exists("mid")
        procs.kill(node)
        with pytest.raises((TransferError, OSError)):
            c.write_put(pending, blob(4 << 20, 9))
        if client_revokes:
            assert c.revoke_puts([pending]) == [Status.OK]
        assert not c.exists("mid")
        # A put racing the node's death fails as a whole and is revoked by the client.
        assert c.put("during", blob(1 << 20, 3)) == Status.TRANSFER_FAILED
        assert not c.exists("during")
        wait_until(lambda: c.stats()["nodes"] == 0)  # heartbeats stopped: node dropped
        assert c.stats()["pending_puts"] == 0
        assert c.batch_exists(["mid", "during", "before"]) == [False, False, False]
        assert c.end_puts([pending]) == [Status.NOT_FOUND]


def test_eviction_under_pressure_keeps_recent_and_pinned(procs) -> None:
    _, addr = procs.master("--port", "0", "--high-watermark", "0.9", "--low-watermark", "0.6",
                           "--put-timeout-s", "0.5", "--lease-ttl-s", "0.3", "--grace-s", "0.2")
    procs.node(addr, "small", "1M")
    with KVStoreClient(addr) as c:
        assert c.put("pinned", blob(64 << 10, 0), pinned=True) == Status.OK
        for i in range(40):
            deadline = time.monotonic() + 10
            # Evicted bytes wait out their tokens before reuse, so a put may briefly see NO_SPACE.
            while (st := c.put(f"e/{i}", blob(64 << 10, i + 1))) == Status.NO_SPACE:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert st == Status.OK
        st = c.stats()
        assert st["evictions"] > 0 and st["used_bytes"] <= st["capacity_bytes"]
        assert c.exists("pinned")
        present = c.batch_exists([f"e/{i}" for i in range(40)])
        assert present[-1] and not present[0]  # approximately LRU: oldest went first
        out = np.zeros(64 << 10, dtype=np.uint8)
        assert c.get("e/39", out) == 64 << 10 and np.array_equal(out, blob(64 << 10, 40))
