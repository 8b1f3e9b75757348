"""kvstore master HA under mutual TLS, real processes on 127.0.0.1: the standby follows over the
authenticated channel with its kvstore-master certificate, another role may not follow (the feed
holds every object's placement), and a failover keeps every object."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import grpc
import pytest

from pdcluster._proto import kvstore_pb2 as pb
from pdcluster._proto import kvstore_pb2_grpc as pb_grpc
from pdcluster.kvstore import KVStoreClient, Status
from pdcluster.kvstore.rpc import make_channel
from pdcluster.security.pki import init_pki


def _wait(cond: Callable[[], bool], what: str, bound_s: float = 60.0) -> None:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        try:
            if cond():
                return
        except grpc.RpcError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _tls(ident) -> list[str]:  # noqa: ANN001
    return ["--tls-cert", ident.cert, "--tls-key", ident.key]


def test_mtls_pair_fails_over_and_guards_the_feed(procs, tmp_path) -> None:  # noqa: ANN001
    ca = init_pki(tmp_path / "pki")
    ma, mb = ca.issue("kvstore-master", "master-a"), ca.issue("kvstore-master", "master-b")
    worker = ca.issue("worker", "prefill-0")
    ports = (procs.free_port(), procs.free_port())
    addrs = [f"127.0.0.1:{p}" for p in ports]
    both = ",".join(addrs)

    def master(i: int, ident, *ha: str):  # noqa: ANN001, ANN202
        return procs.spawn("pdcluster.kvstore.master", "--port", str(ports[i]), "--node-timeout-s", "30",
                           "--data-dir", os.path.join(procs.tmp, f"m{i}"), "--failover-timeout-s", "1",
                           *_tls(ident), "--tls-client-ca", ident.ca, *ha)

    primary, ready = master(0, ma, "--peer", addrs[1])
    assert ready["role"] == "primary"
    _, ready = master(1, mb, "--standby-of", addrs[0])
    assert ready["role"] == "standby"
    for i in range(2):
        node = ca.issue("kvstore-node", f"n{i}")
        procs.node(both, f"n{i}", "8M", "--tls-ca", node.ca, "--tls-cert", node.cert, "--tls-key", node.key)

    def stub(addr: str, ident):  # noqa: ANN001, ANN202
        ch = make_channel(addr, tls_ca=ident.ca, tls_cert=ident.cert, tls_key=ident.key)
        return ch, pb_grpc.KVStoreMasterStub(ch)

    ch, w = stub(addrs[0], worker)
    try:
        with pytest.raises(grpc.RpcError) as e:
            next(iter(w.FollowOpLog(pb.KVFollowRequest(follower_id="spy"), timeout=5)))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        ch.close()

    def objects(addr: str) -> int:
        ch, s = stub(addr, worker)
        try:
            return s.Stats(pb.KVStatsRequest(), timeout=5).objects
        finally:
            ch.close()

    def is_primary(addr: str) -> bool:
        ch, s = stub(addr, worker)
        try:
            return s.GetRole(pb.KVRoleRequest(), timeout=5).primary
        finally:
            ch.close()

    with KVStoreClient(both, tls_ca=worker.ca, tls_cert=worker.cert, tls_key=worker.key) as c:
        for i in range(5):
            assert c.put(f"k{i}", bytes([i]) * 50_000) == Status.OK
        _wait(lambda: objects(addrs[1]) == 5, "the standby to hold every object")
        procs.kill(primary)
        _wait(lambda: is_primary(addrs[1]), "the standby to take over")
        for i in range(5):
            assert c.get_bytes(f"k{i}") == bytes([i]) * 50_000
        assert c.put("after", b"x" * 100) == Status.OK
