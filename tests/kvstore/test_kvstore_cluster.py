"""Master + storage nodes as real processes; the client runs in the test process."""

from __future__ import annotations

import threading
import urllib.request

import numpy as np
import pytest

from pdcluster._proto import kvstore_pb2 as pb
from pdcluster._proto import kvstore_pb2_grpc as pb_grpc
from pdcluster.kvstore import KVStoreClient, Status
from pdcluster.kvstore.rpc import make_channel


def blob(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.fixture
def client(cluster) -> KVStoreClient:
    with KVStoreClient(cluster.master_addr) as c:
        yield c


def test_put_get_with_replicas_on_distinct_nodes(cluster, client) -> None:
    data = blob(3 << 20, 1)
    assert client.put("rep", data, replica_num=2) == Status.OK
    with make_channel(cluster.master_addr) as ch:
        res = pb_grpc.KVStoreMasterStub(ch).GetReplicas(pb.KVGetReplicasRequest(keys=["rep"])).results[0]
    assert sorted(r.node_id for r in res.replicas) == ["node0", "node1"]
    out = np.zeros_like(data)
    assert client.get("rep", out) == data.nbytes and np.array_equal(out, data)  # shared-memory path
    with KVStoreClient(cluster.master_addr, use_shm=False, num_streams=4) as tcp:
        out[:] = 0
        assert tcp.get("rep", out) == data.nbytes and np.array_equal(out, data)  # TCP, several streams
        assert tcp.put("rep", data) == Status.ALREADY_EXISTS  # immutable: a second put is a no-op
        small = blob(5000, 2)
        assert tcp.put("tcp-written", small) == Status.OK
    assert client.get_bytes("tcp-written") == small.tobytes()


def test_batch_apis_and_misses(client) -> None:
    keys = [f"batch/{i}" for i in range(12)]
    srcs = [blob(1000 * (i + 1), i) for i in range(12)]
    assert client.batch_put(keys, srcs) == [Status.OK] * 12
    dests = [np.zeros(20_000, dtype=np.uint8) for _ in range(13)]
    sizes = client.batch_get(keys + ["batch/missing"], dests)
    assert sizes == [s.nbytes for s in srcs] + [None]
    for s, d in zip(srcs, dests, strict=False):
        assert np.array_equal(d[:s.nbytes], s)
    assert client.batch_exists(["batch/0", "batch/missing", "batch/11"]) == [True, False, True]
    assert client.batch_remove(["batch/0", "batch/missing"]) == [Status.OK, Status.NOT_FOUND]
    assert not client.exists("batch/0") and client.get("batch/0", dests[0]) is None
    with pytest.raises(ValueError):
        client.get("batch/5", bytearray(10))  # destination too small


def test_concurrent_puts_of_one_key_exactly_one_wins(cluster) -> None:
    results: dict[int, Status] = {}
    clients = [KVStoreClient(cluster.master_addr) for _ in range(6)]
    barrier = threading.Barrier(6)

    def put(i: int) -> None:
        barrier.wait()
        results[i] = clients[i].put("contended", blob(1 << 20, 100 + i))

    threads = [threading.Thread(target=put, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, st in results.items() if st == Status.OK]
    assert len(winners) == 1
    assert all(st in (Status.IN_PROGRESS, Status.ALREADY_EXISTS) for i, st in results.items() if i != winners[0])
    out = np.zeros(1 << 20, dtype=np.uint8)
    clients[0].get("contended", out)
    assert np.array_equal(out, blob(1 << 20, 100 + winners[0]))
    for c in clients:
        c.close()


def test_stats_and_metrics_endpoint(cluster, client) -> None:
    client.put("metrics/x", b"x" * 100)
    client.get("metrics/x", bytearray(100))
    client.get("metrics/none", bytearray(100))
    st = client.stats()
    assert st["nodes"] == 2 and st["objects"] >= 1 and st["hits"] >= 1 and st["misses"] >= 1
    text = urllib.request.urlopen(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=5).read().decode()
    for name in ("pdcluster_kvstore_objects", "pdcluster_kvstore_hit_rate", "pdcluster_kvstore_evictions_total",
                 "pdcluster_kvstore_capacity_bytes"):
        assert name in text
