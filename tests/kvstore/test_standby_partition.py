"""A 2-master kvstore pair partitioned (both alive, cut from each other by FaultProxy blackholes):
the standby must not become a second primary. With two masters there is no quorum, so the
standby promotes only on evidence that the primary process is gone (its port refuses
connections) or on the operator's word (SIGUSR1); silence is not evidence (kvstore/takeover.py).

Every wait polls with a generous bound; the failover timeout only decides when the standby
first asks, never what the test asserts."""

from __future__ import annotations

import os
import signal

import grpc
import pytest
from chaos.fault_proxy import FaultProxy
from standby_pair import Pair, _objects, _role, _stub, _wait

from pdcluster._proto import kvstore_pb2 as pb
from pdcluster.kvstore import KVStoreClient, Status


def _counter(addr: str, name: str) -> float:
    ch, stub = _stub(addr)
    try:
        return stub.Stats(pb.KVStatsRequest(), timeout=5).counters.get(name, 0.0)
    finally:
        ch.close()


def _refuses_writes(addr: str) -> None:
    ch, stub = _stub(addr)
    try:
        with pytest.raises(grpc.RpcError) as e:
            stub.PutStart(pb.KVPutStartRequest(items=[pb.KVPutItem(key="split-brain", size=8)]), timeout=5)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "NOT_PRIMARY" in e.value.details()
    finally:
        ch.close()


def _log_of(procs, proc) -> str:  # noqa: ANN001
    i = procs.started.index(proc)
    with open(os.path.join(procs.tmp, f"master-{i}.log"), errors="replace") as f:
        return f.read()


def test_partitioned_standby_does_not_take_over(procs) -> None:  # noqa: ANN001
    """Symmetric partition: the standby stays a standby (writes NOT_PRIMARY, no new epoch), counts
    and logs its refusal naming the primary; the primary keeps serving alone; once healed the
    standby follows again and holds what was written meanwhile."""
    p = Pair(procs)
    to_a, to_b = FaultProxy(p.addrs[0]), FaultProxy(p.addrs[1])
    try:
        a, _ = procs.spawn("pdcluster.kvstore.master", "--port", str(p.ports[0]), "--node-timeout-s", "60",
                           "--data-dir", os.path.join(procs.tmp, "a"), "--failover-timeout-s", "1",
                           "--replication-ack-timeout-s", "1", "--peer", to_b.addr)
        b, ready = procs.spawn("pdcluster.kvstore.master", "--port", str(p.ports[1]), "--node-timeout-s", "60",
                               "--data-dir", os.path.join(procs.tmp, "b"), "--failover-timeout-s", "1",
                               "--standby-of", to_a.addr)
        assert ready["role"] == "standby"
        for i in range(2):
            procs.node(p.both, f"node{i}")
        epoch = _role(p.addrs[0]).epoch
        with KVStoreClient(p.both, rpc_timeout_s=3) as c:
            assert c.put("before", b"b" * 3000) == Status.OK
            _wait(lambda: _objects(p.addrs[1]) == 1, "the standby to hold the object")
            to_a.blackhole()
            to_b.blackhole()
            _wait(lambda: _counter(p.addrs[1], "takeovers_refused") >= 2, "the standby to refuse a takeover twice")
            r = _role(p.addrs[1])
            assert not r.primary and r.epoch == epoch
            _refuses_writes(p.addrs[1])
            assert c.put("during", b"d" * 3000) == Status.OK  # the primary serves alone
            assert _role(p.addrs[0]).primary and _role(p.addrs[0]).epoch == epoch
            assert _counter(p.addrs[0], "replication_followers_dropped") >= 1
            to_a.clear()
            to_b.clear()
            _wait(lambda: _objects(p.addrs[1]) == 2, "the healed standby to follow again")
            assert not _role(p.addrs[1]).primary and _role(p.addrs[1]).epoch == epoch
            assert c.get_bytes("during") == b"d" * 3000
        log = _log_of(procs, b)
        assert f"primary {to_a.addr} silent" in log and "not taking over" in log
        assert a.poll() is None
    finally:
        to_a.close()
        to_b.close()


@pytest.mark.slow
def test_stopped_primary_needs_the_operator(procs) -> None:  # noqa: ANN001
    """SIGSTOP the primary (alive to the kernel, silent to the standby): by default no takeover;
    SIGUSR1 to the standby (the operator's word) promotes it; the resumed old primary steps down."""
    p = Pair(procs)
    primary, _ = p.start(0, standby=False, node_timeout_s=60)
    standby, _ = p.start(1, standby=True, node_timeout_s=60)
    for i in range(2):
        procs.node(p.both, f"node{i}")
    with KVStoreClient(p.both, rpc_timeout_s=2) as c:
        assert c.put("before-stop", b"s" * 500) == Status.OK
        _wait(lambda: _objects(p.addrs[1]) == 1, "the standby to hold the object")
        os.kill(primary.pid, signal.SIGSTOP)
        try:
            _wait(lambda: _counter(p.addrs[1], "takeovers_refused") >= 1, "the standby to refuse a takeover")
            assert not _role(p.addrs[1]).primary
            os.kill(standby.pid, signal.SIGUSR1)
            _wait(lambda: _role(p.addrs[1]).primary, "the operator-promoted standby")
            assert c.put("while-stopped", b"t" * 500) == Status.OK
        finally:
            os.kill(primary.pid, signal.SIGCONT)
        _wait(lambda: not _role(p.addrs[0]).primary, "the resumed old primary to step down")
        assert c.get_bytes("before-stop") == b"s" * 500 and c.get_bytes("while-stopped") == b"t" * 500
