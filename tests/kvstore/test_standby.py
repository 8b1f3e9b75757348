"""kvstore master high availability with real processes: a standby follows the primary's op log,
takes over when the primary is SIGKILLed, and the old primary comes back as a standby (fencing).

Timeouts here only decide *when* a takeover happens; every wait polls with a generous bound.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import grpc
import pytest

from pdcluster._proto import kvstore_pb2 as pb
from pdcluster._proto import kvstore_pb2_grpc as pb_grpc
from pdcluster.kvstore import KVStoreClient, Status

BOUND_S = 60.0


def _wait(cond: Callable[[], bool], what: str, bound_s: float = BOUND_S) -> None:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        try:
            if cond():
                return
        except grpc.RpcError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _stub(addr: str) -> tuple[grpc.Channel, pb_grpc.KVStoreMasterStub]:
    ch = grpc.insecure_channel(addr)
    return ch, pb_grpc.KVStoreMasterStub(ch)


def _role(addr: str) -> pb.KVRoleResponse:
    ch, stub = _stub(addr)
    try:
        return stub.GetRole(pb.KVRoleRequest(), timeout=5)
    finally:
        ch.close()


def _objects(addr: str) -> int:
    ch, stub = _stub(addr)
    try:
        return stub.Stats(pb.KVStatsRequest(), timeout=5).objects
    finally:
        ch.close()


class Pair:
    def __init__(self, procs) -> None:  # noqa: ANN001
        self.procs = procs
        self.ports = (procs.free_port(), procs.free_port())
        self.addrs = tuple(f"127.0.0.1:{p}" for p in self.ports)
        self.both = ",".join(self.addrs)

    def start(self, i: int, *, standby: bool) -> tuple[object, dict]:
        other = self.addrs[1 - i]
        ha = ["--standby-of", other] if standby else ["--peer", other]
        return self.procs.spawn("pdcluster.kvstore.master", "--port", str(self.ports[i]), "--node-timeout-s", "5",
                                "--grace-s", "0.5", "--data-dir", os.path.join(self.procs.tmp, f"master{i}"),
                                "--failover-timeout-s", "1", *ha)


@pytest.fixture
def pair(procs) -> tuple[Pair, object]:  # noqa: ANN001
    p = Pair(procs)
    primary, ready = p.start(0, standby=False)
    assert ready["role"] == "primary"
    _, ready = p.start(1, standby=True)
    assert ready["role"] == "standby"
    for i in range(2):
        procs.node(p.both, f"node{i}")
    return p, primary


def _payload(i: int, n: int) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(n))


def test_standby_refuses_writes_and_follows(pair) -> None:  # noqa: ANN001
    p, _ = pair
    ch, stub = _stub(p.addrs[1])
    try:
        with pytest.raises(grpc.RpcError) as e:
            stub.PutStart(pb.KVPutStartRequest(items=[pb.KVPutItem(key="k", size=8)]), timeout=5)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "NOT_PRIMARY" in e.value.details()
    finally:
        ch.close()
    assert _role(p.addrs[0]).primary and not _role(p.addrs[1]).primary
    assert _role(p.addrs[1]).primary_address == p.addrs[0]
    with KVStoreClient(p.both) as c:
        assert c.put("followed", b"z" * 1000) == Status.OK
    _wait(lambda: _objects(p.addrs[1]) == 1, "the standby to apply the put")


def test_primary_sigkill_standby_takes_over_nothing_lost(pair) -> None:  # noqa: ANN001
    p, primary = pair
    sizes = [100, 5000, 300_000, 1 << 20]  # the arena path and the two-phase path
    keys = [f"obj-{i}" for i in range(12)]
    with KVStoreClient(p.both) as c:
        for i, key in enumerate(keys):
            assert c.put(key, _payload(i, sizes[i % len(sizes)])) == Status.OK
        # A put in flight at the kill: started (replicated as PENDING), bytes written, not ended.
        [(status, pending)] = c.start_puts(["in-flight"], [4096])
        assert status == Status.OK and pending is not None
        c.write_put(pending, b"f" * 4096)
        _wait(lambda: _objects(p.addrs[1]) == len(keys), "the standby to hold every object")

        p.procs.kill(primary)  # SIGKILL
        _wait(lambda: _role(p.addrs[1]).primary, "the standby to take over")
        assert _role(p.addrs[1]).epoch >= 2

        # The same client, not reconfigured: every object, the same bytes.
        for i, key in enumerate(keys):
            assert c.get_bytes(key) == _payload(i, sizes[i % len(sizes)]), key
        # The in-flight put fails clearly and was never visible; the key is free again.
        assert c.end_puts([pending]) == [Status.NOT_FOUND]
        assert c.get_bytes("in-flight") is None and not c.exists("in-flight")
        assert c.put("in-flight", b"g" * 4096) == Status.OK
        assert c.put("after-failover", b"y" * 70_000) == Status.OK
        assert c.get_bytes("after-failover") == b"y" * 70_000

        # The old primary restarted with its own command line comes back as a standby (fenced).
        _, ready = p.start(0, standby=False)
        assert ready["role"] == "standby"
        old = _role(p.addrs[0])
        assert not old.primary and old.primary_address == p.addrs[1]
        _wait(lambda: _objects(p.addrs[0]) == len(keys) + 2, "the old primary to follow the new one")
        assert c.put("after-rejoin", b"r" * 10) == Status.OK
        assert c.get_bytes("after-rejoin") == b"r" * 10
        assert _role(p.addrs[1]).primary


def test_storage_nodes_follow_the_new_primary(pair) -> None:  # noqa: ANN001
    p, primary = pair
    with KVStoreClient(p.both) as c:
        assert c.put("before", b"b" * 2048) == Status.OK
        p.procs.kill(primary)
        _wait(lambda: _role(p.addrs[1]).primary, "the standby to take over")
        # Past the new primary's node timeout (5 s) the nodes are still there: they heartbeat it.
        time.sleep(6)
        ch, stub = _stub(p.addrs[1])
        try:
            assert stub.Stats(pb.KVStatsRequest(), timeout=5).nodes == 2
        finally:
            ch.close()
        assert c.put("after", b"a" * 2048) == Status.OK
        assert c.get_bytes("before") == b"b" * 2048
