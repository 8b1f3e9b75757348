"""The master's same-host lookup socket (kvstore/lookup_socket.py, lookup_client.py): gets and
small-put commits of a same-host client go over it once OpenLookup gave a ticket, a commit only
answered after the replication wait; a bad, reused or expired ticket is
refused and counted; a session ends with its ticket's time; a standby's NOT_PRIMARY and any
failure on the socket send the client back to gRPC (the get still succeeds); the socket lives
in a private directory and goes with the master."""

from __future__ import annotations

import os
import secrets
import socket
import stat
import time
from collections.abc import Iterator

import numpy as np
import pytest

from pdcluster._proto import kvstore_pb2 as pb
from pdcluster.kvstore import KVStoreClient, MasterConfig, MasterServer, Status, StorageNode
from pdcluster.kvstore.lookup_socket import (
    COMMIT_ARENA,
    GET_REPLICAS,
    HELLO,
    NOT_PRIMARY,
    OK,
    REPLY,
    REQUEST,
    LookupSocket,
    recv_exact,
)
from pdcluster.kvstore.master_rpc import MasterRPC

SECRET = secrets.token_bytes(32)
KEY = secrets.token_bytes(32)


@pytest.fixture
def cluster() -> Iterator[MasterServer]:
    master = MasterServer(MasterConfig(node_timeout_s=30.0), SECRET).start()
    node = StorageNode(master.address, SECRET, [4 << 20], node_id="n0").start()
    try:
        deadline = time.monotonic() + 30
        with KVStoreClient(master.address) as c:
            while c.stats()["nodes"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        yield master
    finally:
        node.stop()
        master.stop()


def _objects(n: int, size: int) -> list[np.ndarray]:
    rng = np.random.default_rng(size)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]


def test_gets_go_over_the_socket_and_read_the_right_bytes(cluster: MasterServer) -> None:
    path = cluster.servicer.lookup.path
    mode = os.stat(os.path.dirname(path)).st_mode
    assert stat.S_IMODE(mode) == 0o700 and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    keys, src = [f"k{i}" for i in range(8)], _objects(8, 3000)
    with KVStoreClient(cluster.address, object_key=KEY) as c:
        assert c.batch_put(keys, src) == [Status.OK] * 8
        for _ in range(3):
            out = [np.zeros(3000, np.uint8) for _ in keys]
            assert c.batch_get(keys, out) == [3000] * 8
            assert all(np.array_equal(a, b) for a, b in zip(src, out, strict=True))
        assert c.get_bytes("missing") is None
        # the small put: one CommitArena (write arena) over the socket, then four lookups
        assert c.lookup_counters == {"lookup_socket_gets": 4, "lookup_socket_commits": 1, "lookup_socket_failures": 0}
        stats = c.stats()
    assert stats["lookup_sessions"] == 1 and stats["lookup_requests"] == 5 and stats["lookup_refused"] == 0
    with KVStoreClient(cluster.address, object_key=KEY, lookup_socket=False) as grpc_only:
        out = [np.zeros(3000, np.uint8) for _ in keys]
        assert grpc_only.batch_get(keys, out) == [3000] * 8 and grpc_only.lookup_counters == {}


def test_a_standby_answer_or_a_broken_session_falls_back_to_grpc(cluster: MasterServer) -> None:
    keys, src = ["a", "b"], _objects(2, 5000)
    lookup = cluster.servicer.lookup
    with KVStoreClient(cluster.address, object_key=KEY) as c:
        assert c.batch_put(keys, src) == [Status.OK] * 2
        gate = lookup._gate
        lookup._gate = lambda: (False, 7)  # what a standby says
        try:
            assert c.batch_get(keys, [np.zeros(5000, np.uint8) for _ in keys]) == [5000, 5000]
            time.sleep(1.1)  # RETRY_S
            assert c.batch_put(["c"], _objects(1, 4000)) == [Status.OK]  # the commit: refused there, then gRPC
        finally:
            lookup._gate = gate
        assert c.lookup_counters["lookup_socket_failures"] == 2  # both then answered over gRPC
        assert c.lookup_counters["lookup_socket_commits"] == 1  # the first put's
        time.sleep(1.1)  # RETRY_S: the next get opens a new session
        out = [np.zeros(5000, np.uint8) for _ in keys]
        assert c.batch_get(keys, out) == [5000, 5000] and np.array_equal(out[1], src[1])
        assert c.lookup_counters["lookup_socket_gets"] == 1


def _raw_session(path: str, ticket: bytes) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(path)
    s.sendall(HELLO + ticket)
    return s


def _ask(s: socket.socket, keys: list[str]) -> tuple[int, int, pb.KVGetReplicasResponse]:
    body = pb.KVGetReplicasRequest(keys=keys).SerializeToString()
    s.sendall(REQUEST.pack(GET_REPLICAS, len(body)) + body)
    code, epoch, n = REPLY.unpack(recv_exact(s, REPLY.size))
    return code, epoch, pb.KVGetReplicasResponse.FromString(recv_exact(s, n) if n else b"")


class _Hub:
    """Records what a ReplicationHub would be asked (the semi-synchronous wait of a write)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def begin_call(self) -> None:
        self.calls.append("begin")

    def wait_replicated(self) -> None:
        self.calls.append("wait")


def test_a_commit_waits_for_replication_and_a_lookup_does_not() -> None:
    hub = _Hub()

    def commit(req: pb.KVCommitArenaRequest) -> pb.KVCommitArenaResponse:
        hub.calls.append("commit")
        return pb.KVCommitArenaResponse(statuses=[0] * len(req.items))

    lk = LookupSocket(lambda req: pb.KVGetReplicasResponse(), lambda: (True, 2), max_batch=4, commit_arena=commit,
                      replication=hub)
    try:
        ticket, _ = lk.issue()
        with _raw_session(lk.path, ticket) as s:
            assert recv_exact(s, 1) == b"\x00"
            assert _ask(s, ["x"])[0] == OK and hub.calls == []
            body = pb.KVCommitArenaRequest(arena_id="a1", items=[pb.KVArenaItem(key="k", offset=0, size=1)]).SerializeToString()
            s.sendall(REQUEST.pack(COMMIT_ARENA, len(body)) + body)
            code, epoch, n = REPLY.unpack(recv_exact(s, REPLY.size))
            assert (code, epoch) == (OK, 2) and list(pb.KVCommitArenaResponse.FromString(recv_exact(s, n)).statuses) == [0]
            assert hub.calls == ["begin", "commit", "wait"]
            s.sendall(REQUEST.pack(99, 0))  # an unknown method
            assert REPLY.unpack(recv_exact(s, REPLY.size))[0] != OK
    finally:
        lk.close()


def test_tickets_are_single_use_and_sessions_end() -> None:
    now = [1000.0]
    state = {"primary": True}

    def answer(req: pb.KVGetReplicasRequest) -> pb.KVGetReplicasResponse:
        return pb.KVGetReplicasResponse(results=[pb.KVGetReplicasResult(key=k) for k in req.keys])

    lk = LookupSocket(answer, lambda: (state["primary"], 3), max_batch=4, session_s=30.0, clock=lambda: now[0])
    try:
        for bad in (secrets.token_bytes(32), b""):  # an unknown ticket, a short hello
            with _raw_session(lk.path, bad) as s:
                if not bad:
                    s.shutdown(socket.SHUT_WR)
                with pytest.raises(ConnectionError):
                    recv_exact(s, 1)
        ticket, expiry_ms = lk.issue()
        assert expiry_ms == 1030 * 1000
        with _raw_session(lk.path, ticket) as s:
            assert recv_exact(s, 1) == b"\x00"
            code, epoch, resp = _ask(s, ["x", "y"])
            assert (code, epoch, [r.key for r in resp.results]) == (OK, 3, ["x", "y"])
            assert _ask(s, ["1", "2", "3", "4", "5"])[0] != OK  # over max_batch
            state["primary"] = False
            assert _ask(s, ["x"])[0] == NOT_PRIMARY
        with _raw_session(lk.path, ticket) as s, pytest.raises(ConnectionError):  # used once already
            recv_exact(s, 1)
        late, _ = lk.issue()
        now[0] += 31.0  # past its expiry before it was used
        with _raw_session(lk.path, late) as s, pytest.raises(ConnectionError):
            recv_exact(s, 1)
        assert lk.counters["lookup_refused"] == 4 and lk.counters["lookup_sessions"] == 1
    finally:
        lk.close()
    assert not os.path.exists(os.path.dirname(lk.path))


def test_an_idle_session_ends_with_its_ticket() -> None:
    lk = LookupSocket(lambda req: pb.KVGetReplicasResponse(), lambda: (True, 0), max_batch=4, session_s=0.5)
    try:
        ticket, _ = lk.issue()
        with _raw_session(lk.path, ticket) as s:
            assert recv_exact(s, 1) == b"\x00"
            time.sleep(0.8)
            with pytest.raises((ConnectionError, OSError)):
                _ask(s, ["x"])
    finally:
        lk.close()


def test_an_answer_from_a_lower_epoch_is_refused_with_two_masters() -> None:
    rpc = MasterRPC("127.0.0.1:1,127.0.0.1:2", timeout_s=0.1)
    try:
        assert rpc.accept_epoch(4) and rpc.accept_epoch(5)
        assert not rpc.accept_epoch(4)  # a fenced old primary's answer
    finally:
        rpc.close()


def test_undecodable_master_requests_are_invalid_argument(cluster: MasterServer) -> None:
    """The master (a sync grpc.server) answers bytes that are no request message with
    INVALID_ARGUMENT naming the type (pdcluster/grpc_decode.py), and keeps serving."""
    import grpc

    with grpc.insecure_channel(cluster.address) as ch:
        exists = ch.unary_unary("/pdcluster.v1.KVStoreMaster/Exists", request_serializer=lambda b: b,
                                response_deserializer=lambda b: b)
        for junk in (b"\x0a\x02\xff\xfe", b"\xff" * 32):
            with pytest.raises(grpc.RpcError) as e:
                exists(junk, timeout=30)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
            assert "pdcluster.v1.KVExistsRequest" in e.value.details()
    keys, src = ["after"], _objects(1, 100)
    with KVStoreClient(cluster.address, object_key=KEY) as c:
        assert c.batch_put(keys, src) == [Status.OK]
