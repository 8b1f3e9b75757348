"""kvstore master high availability with real processes: a standby follows the primary's op log,
takes over when the primary is SIGKILLed, and the old primary comes back as a standby (fencing).

Timeouts here only decide *when* a takeover happens; every wait polls with a generous bound.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest
from standby_pair import Pair, _objects, _role, _stub, _wait

from pdcluster._proto import kvstore_pb2 as pb
from pdcluster.kvstore import KVStoreClient, Status


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
    with KVStoreClient(f"{p.addrs[1]},{p.addrs[0]}") as c:  # the standby first: NOT_PRIMARY moves it on
        assert c.get_bytes("followed") == b"z" * 1000
        assert c.put("via-redirect", b"v" * 100) == Status.OK


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
        restarted, ready = p.start(0, standby=False)
        assert ready["role"] == "standby"
        old = _role(p.addrs[0])
        assert not old.primary and old.primary_address == p.addrs[1]
        _wait(lambda: _objects(p.addrs[0]) == len(keys) + 2, "the old primary to follow the new one")
        assert c.put("after-rejoin", b"r" * 10) == Status.OK
        assert c.get_bytes("after-rejoin") == b"r" * 10
        assert _role(p.addrs[1]).primary

        # And back: the second primary dies too, the rejoined one takes over with everything.
        _wait(lambda: _objects(p.addrs[0]) == len(keys) + 3, "the rejoined standby to catch up")
        [second] = [proc for proc in p.procs.started if proc.poll() is None and "--port" in proc.args
                    and proc.args[proc.args.index("--port") + 1] == str(p.ports[1])]
        p.procs.kill(second)
        _wait(lambda: _role(p.addrs[0]).primary, "the rejoined master to take over")
        assert _role(p.addrs[0]).epoch >= 3
        for i, key in enumerate(keys):
            assert c.get_bytes(key) == _payload(i, sizes[i % len(sizes)]), key
        assert c.get_bytes("after-rejoin") == b"r" * 10
        assert c.put("third-term", b"3" * 3000) == Status.OK
        assert restarted.poll() is None


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


def test_puts_running_through_the_kill_complete_or_fail_clearly(pair) -> None:  # noqa: ANN001
    """A writer keeps putting while the primary is SIGKILLed: each put ends OK (and is then
    readable with its bytes) or fails (a status or KVStoreError); none is half-visible: a key
    is absent or holds exactly its bytes (a put whose reply died with the primary may have landed,
    and a retry then answers ALREADY_EXISTS)."""
    p, primary = pair
    done: dict[str, bool] = {}
    stop = threading.Event()

    def writer() -> None:
        with KVStoreClient(p.both, rpc_timeout_s=5) as c:
            i = 0
            while not stop.is_set():
                key = f"w-{i}"
                try:
                    done[key] = c.put(key, _payload(i, 20_000 if i % 2 else 300)) == Status.OK
                except Exception:  # noqa: BLE001 - a clear failure is allowed, a half-visible object is not
                    done[key] = False
                i += 1

    t = threading.Thread(target=writer)
    t.start()
    try:
        _wait(lambda: len(done) >= 20, "some puts before the kill")
        p.procs.kill(primary)
        _wait(lambda: _role(p.addrs[1]).primary, "the standby to take over")
        before = len(done)
        _wait(lambda: sum(done.values()) > 0 and len(done) >= before + 20, "puts after the takeover")
    finally:
        stop.set()
        t.join(120)
    with KVStoreClient(p.both) as c:
        for key, ok in done.items():
            i = int(key.split("-")[1])
            got = c.get_bytes(key)
            if ok or got is not None:  # all or nothing: a reply lost at the kill may hide a success
                assert got == _payload(i, 20_000 if i % 2 else 300), key


def test_stopped_primary_is_fenced_when_it_resumes(procs) -> None:  # noqa: ANN001
    """SIGSTOP the primary: the standby takes over (told to on silence: by default a silent
    primary may be a partitioned one, test_standby_partition.py); on SIGCONT the old primary
    (epoch below) steps down and refuses writes, and the client keeps working on the new one."""
    p = Pair(procs)
    primary, _ = p.start(0, standby=False, node_timeout_s=60)
    p.start(1, standby=True, node_timeout_s=60, extra=("--takeover", "on-silence"))
    for i in range(2):
        procs.node(p.both, f"node{i}")
    with KVStoreClient(p.both, rpc_timeout_s=2) as c:
        assert c.put("before-stop", b"s" * 5000) == Status.OK
        _wait(lambda: _objects(p.addrs[1]) == 1, "the standby to hold the object")
        os.kill(primary.pid, signal.SIGSTOP)
        try:
            _wait(lambda: _role(p.addrs[1]).primary, "the standby to take over")
            assert c.put("while-stopped", b"t" * 5000) == Status.OK
        finally:
            os.kill(primary.pid, signal.SIGCONT)
        _wait(lambda: not _role(p.addrs[0]).primary, "the resumed old primary to step down")
        assert _role(p.addrs[0]).epoch == _role(p.addrs[1]).epoch  # it learnt the new term
        ch, stub = _stub(p.addrs[0])
        try:
            with pytest.raises(grpc.RpcError) as e:
                stub.PutStart(pb.KVPutStartRequest(items=[pb.KVPutItem(key="stale", size=8)]), timeout=5)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        finally:
            ch.close()
        assert c.get_bytes("before-stop") == b"s" * 5000 and c.get_bytes("while-stopped") == b"t" * 5000
        assert c.put("after-resume", b"u" * 10) == Status.OK
        _wait(lambda: _objects(p.addrs[0]) == 3, "the old primary to follow the new one")


def test_standby_disk_is_a_replica(pair) -> None:  # noqa: ANN001
    """The standby writes what it follows to its own data directory: with both masters killed,
    the standby restarted alone (its peer down) recovers every object from its own disk."""
    p, primary = pair
    with KVStoreClient(p.both) as c:
        for i in range(6):
            assert c.put(f"d-{i}", _payload(i, 40_000)) == Status.OK
        _wait(lambda: _objects(p.addrs[1]) == 6, "the standby to hold every object")
        [standby] = [proc for proc in p.procs.started if proc.poll() is None and "--standby-of" in proc.args]
        p.procs.kill(standby)
        p.procs.kill(primary)
        _, ready = p.start(1, standby=False)  # `--peer` the dead primary: recovers and serves
        assert ready["role"] == "primary"
        for i in range(6):
            assert c.get_bytes(f"d-{i}") == _payload(i, 40_000)
        assert c.put("on-the-replica", b"q" * 100) == Status.OK


def test_snapshot_goes_in_pieces(monkeypatch, tmp_path) -> None:  # noqa: ANN001
    """In-process pair: a state bigger than one piece reaches the standby whole."""
    import secrets

    from pdcluster.kvstore import MasterConfig, MasterServer, StorageNode, failover
    from pdcluster.kvstore.standby import HAOptions

    from .conftest import free_port

    monkeypatch.setattr(failover, "SNAPSHOT_PIECE", 256)
    secret = secrets.token_bytes(32)
    pa, pb_ = free_port(), free_port()
    cfg = MasterConfig(node_timeout_s=30)
    a = MasterServer(cfg, secret, port=pa, data_dir=str(tmp_path / "a"), ha=HAOptions(peer=f"127.0.0.1:{pb_}")).start()
    node = StorageNode(a.address, secret, [8 << 20], node_id="n0").start()
    b = None
    try:
        with KVStoreClient(a.address, arena_bytes=0) as c:
            for i in range(40):
                assert c.put(f"p-{i}", b"p" * 1000) == Status.OK
        b = MasterServer(cfg, secret, port=pb_, data_dir=str(tmp_path / "b"),
                         ha=HAOptions(standby_of=a.address)).start()
        assert b.role == "standby"
        _wait(lambda: b.servicer.stats()["objects"] == 40, "the standby to load the snapshot pieces")
    finally:
        node.stop()
        if b is not None:
            b.stop()
        a.stop()
