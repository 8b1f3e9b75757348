"""kvstore master authorization by role under mutual TLS (issue 16, item 2), in-process servers on
127.0.0.1: only storage nodes mount / heartbeat / unmount, and only under their own node id
(a live node's address cannot be moved); only workers put, get and remove; a plaintext peer and
a certificate from another CA are refused at the handshake; only workers get a lookup-socket
ticket (OpenLookup). Every refusal is counted."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import grpc
import pytest

from pdcluster._proto import kvstore_pb2 as pb
from pdcluster._proto import kvstore_pb2_grpc as pb_grpc
from pdcluster.kvstore import KVStoreClient, KVStoreError, MasterConfig, MasterServer, Status, StorageNode
from pdcluster.kvstore.authz import kvstore_policy
from pdcluster.kvstore.rpc import make_channel, server_credentials
from pdcluster.security.pki import Identity, init_pki

SECRET = secrets.token_bytes(32)


@pytest.fixture(scope="module")
def ids(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Identity]:
    ca = init_pki(tmp_path_factory.mktemp("pki") / "cluster")
    other = init_pki(tmp_path_factory.mktemp("pki") / "other")
    return {"master": ca.issue("kvstore-master", "master"), "n0": ca.issue("kvstore-node", "n0"),
            "n1": ca.issue("kvstore-node", "n1"), "worker": ca.issue("worker", "prefill-0"),
            "client": ca.issue("client", "cli"), "foreign": other.issue("worker", "prefill-0")}


@pytest.fixture
def cluster(ids: dict[str, Identity]) -> Iterator[tuple[MasterServer, StorageNode]]:
    m = ids["master"]
    master = MasterServer(MasterConfig(node_timeout_s=30.0), SECRET, credentials=server_credentials(m.cert, m.key, m.ca),
                          role_policy=kvstore_policy()).start()
    n0 = ids["n0"]
    node = StorageNode(master.address, SECRET, [1 << 20], node_id="n0", tls_ca=n0.ca, tls_cert=n0.cert,
                       tls_key=n0.key).start()
    try:
        yield master, node
    finally:
        node.stop()
        master.stop()


def _client(master: MasterServer, ident: Identity) -> KVStoreClient:
    return KVStoreClient(master.address, tls_ca=ident.ca, tls_cert=ident.cert, tls_key=ident.key, rpc_timeout_s=5)


def _stub(master: MasterServer, ident: Identity | None) -> tuple[grpc.Channel, pb_grpc.KVStoreMasterStub]:
    if ident is None:
        ch = make_channel(master.address)
    else:
        ch = make_channel(master.address, tls_ca=ident.ca, tls_cert=ident.cert, tls_key=ident.key)
    return ch, pb_grpc.KVStoreMasterStub(ch)


def _mount(node_id: str, port: int = 9) -> pb.KVMountSegmentRequest:
    return pb.KVMountSegmentRequest(node_id=node_id, data_host="127.0.0.1", data_port=port, host_id="h",
                                    segments=[pb.KVSegmentInfo(segment_id=7, size=1 << 20, incarnation=3)])


def _code(call) -> grpc.StatusCode:  # noqa: ANN001
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code()


def test_only_workers_put_get_and_remove(cluster, ids: dict[str, Identity]) -> None:
    master, _ = cluster
    with _client(master, ids["worker"]) as worker:
        assert worker.put("k", b"kv bytes") == Status.OK
        assert worker.get_bytes("k") == b"kv bytes"
        assert worker.lookup_counters["lookup_socket_gets"] == 1  # its ticket came over mTLS, as a worker
    for name in ("client", "n0"):  # a CA-signed peer of another role
        with _client(master, ids[name]) as other:
            for op in (lambda: other.put("x", b"no"), lambda: other.get_bytes("k"), lambda: other.remove("k")):
                with pytest.raises(KVStoreError, match="PERMISSION_DENIED"):
                    op()
            assert other.stats()["nodes"] == 1  # Stats needs only the handshake
    assert master.role_policy is not None
    refused = master.role_policy.refusals
    assert refused["/pdcluster.v1.KVStoreMaster/ReserveArena:client"] == 1  # a small put starts with an arena
    assert refused["/pdcluster.v1.KVStoreMaster/GetReplicas:client"] == 1
    assert refused["/pdcluster.v1.KVStoreMaster/OpenLookup:client"] == 1  # no lookup-socket ticket either
    assert refused["/pdcluster.v1.KVStoreMaster/OpenLookup:kvstore-node"] == 1
    assert refused["/pdcluster.v1.KVStoreMaster/Remove:kvstore-node"] == 1
    with _client(master, ids["worker"]) as worker:
        assert worker.get_bytes("k") == b"kv bytes"  # nothing was removed


def test_plaintext_and_another_ca_are_refused(cluster, ids: dict[str, Identity]) -> None:
    master, _ = cluster
    request = pb.KVExistsRequest(key="k")
    ch, plain = _stub(master, None)
    with ch:
        assert _code(lambda: plain.Exists(request, timeout=5)) == grpc.StatusCode.UNAVAILABLE
    # Trusting our master's CA but presenting a worker certificate of another CA.
    foreign = ids["foreign"]
    with make_channel(master.address, tls_ca=ids["master"].ca, tls_cert=foreign.cert, tls_key=foreign.key) as ch2:
        stub2 = pb_grpc.KVStoreMasterStub(ch2)
        assert _code(lambda: stub2.Exists(request, timeout=5)) == grpc.StatusCode.UNAVAILABLE


def test_nodes_act_only_for_themselves(cluster, ids: dict[str, Identity]) -> None:
    master, node = cluster
    ch, as_n0 = _stub(master, ids["n0"])
    ch_w, as_worker = _stub(master, ids["worker"])
    with ch, ch_w:
        # A worker certificate may not mount at all (role), n0's not under n1's id (identity).
        assert _code(lambda: as_worker.MountSegment(_mount("n9"), timeout=5)) == grpc.StatusCode.PERMISSION_DENIED
        assert _code(lambda: as_n0.MountSegment(_mount("n1"), timeout=5)) == grpc.StatusCode.PERMISSION_DENIED
        hb = pb.KVHeartbeatRequest(node_id="n1")
        assert _code(lambda: as_n0.Heartbeat(hb, timeout=5)) == grpc.StatusCode.PERMISSION_DENIED
        unmount = pb.KVUnmountSegmentRequest(node_id="n1")
        assert _code(lambda: as_n0.UnmountSegment(unmount, timeout=5)) == grpc.StatusCode.PERMISSION_DENIED
        # n0 is live: even its own certificate cannot point its id at another address.
        assert _code(lambda: as_n0.MountSegment(_mount("n0", port=1), timeout=5)) == grpc.StatusCode.PERMISSION_DENIED
    stats = master.servicer.stats()
    assert stats["refused_wrong_node_id"] == 3 and stats["refused_live_node_moved"] == 1
    assert master.role_policy.refusals["/pdcluster.v1.KVStoreMaster/MountSegment:worker"] == 1
    with _client(master, ids["worker"]) as worker:  # the real n0 still serves
        assert worker.put("after", b"still here") == Status.OK and worker.get_bytes("after") == b"still here"
