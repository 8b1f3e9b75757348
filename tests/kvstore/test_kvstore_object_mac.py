"""kvstore object MACs (issue 16, item 6): the writer MACs each object under the workers' store
key, the master records it at PutEnd / CommitArena (and keeps it across a restart), and every
get checks it: bytes changed on a storage node, or an object without a MAC, are a failed read."""

from __future__ import annotations

import secrets
import struct
import time

import blake3
import numpy as np
import pytest

from pdcluster._proto import kvstore_pb2 as pb
from pdcluster._proto import kvstore_pb2_grpc as pb_grpc
from pdcluster.kvstore import KVStoreClient, KVStoreError, Status
from pdcluster.kvstore.entities import MasterConfig
from pdcluster.kvstore.metadata import MetadataStore
from pdcluster.kvstore.object_mac import check_store_key, mac_matches, object_mac
from pdcluster.kvstore.persistence import load_snapshot, snapshot_state
from pdcluster.kvstore.rpc import make_channel
from pdcluster.transfer import open_shared_region

KEY = secrets.token_bytes(32)


def _blob(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _start(procs, nodes: int = 1) -> str:
    _, addr = procs.master("--port", "0")
    for i in range(nodes):
        procs.node(addr, f"n{i}", "32M")
    deadline = time.monotonic() + 60
    with KVStoreClient(addr) as c:
        while c.stats()["nodes"] < nodes:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    return addr


def _replica(addr: str, key: str) -> pb.KVReplica:
    with make_channel(addr) as ch:
        result = pb_grpc.KVStoreMasterStub(ch).GetReplicas(pb.KVGetReplicasRequest(keys=[key])).results[0]
    assert result.status == Status.OK
    return result


def _flip_stored_byte(addr: str, key: str, at: int) -> None:
    """What a faulty or hostile storage node could do: change an object's bytes in place."""
    replica = _replica(addr, key).replicas[0]
    region = open_shared_region(replica.shm_name, writable=True)
    try:
        region.view[replica.offset + at] ^= 0x40
    finally:
        region.close()


def test_mac_binds_key_name_size_and_bytes() -> None:
    data = memoryview(bytes(range(256)) * 4)
    mac = object_mac(KEY, "a", data)
    assert mac_matches(KEY, "a", data, mac)
    assert not mac_matches(KEY, "b", data, mac)  # the same bytes under another key
    assert not mac_matches(KEY, "a", data[:-1], mac)
    assert not mac_matches(secrets.token_bytes(32), "a", data, mac)
    assert not mac_matches(KEY, "a", data, b"")
    with pytest.raises(ValueError):
        check_store_key(b"short")


def test_mac_layout_puts_the_bytes_first() -> None:
    """The layout is pinned: the object's bytes start the hashed input (on a BLAKE3 chunk
    boundary, its fast path), then key | size | len(key) | tag. A MAC of the earlier layout
    (header first, tag pdkvob01) is refused, never taken for this one."""
    data = memoryview(bytes(range(256)) * 70)
    name = b"key/\xc3\xa9"
    trailer = name + struct.pack("!QI8s", data.nbytes, len(name), b"pdkvob02")
    assert object_mac(KEY, name.decode(), data) == blake3.blake3(bytes(data) + trailer, key=KEY).digest()
    old = blake3.blake3(struct.pack("!8sI", b"pdkvob01", len(name)) + name + struct.pack("!Q", data.nbytes)
                        + bytes(data), key=KEY).digest()
    assert not mac_matches(KEY, name.decode(), data, old)
    empty = memoryview(b"")
    assert mac_matches(KEY, "e", empty, object_mac(KEY, "e", empty))
    assert not mac_matches(KEY, "e", empty, object_mac(KEY, "", memoryview(b"e")))  # name/bytes boundary


def test_puts_record_a_mac_and_gets_check_it(procs) -> None:
    addr = _start(procs)
    big, small = _blob(1 << 20, 1), _blob(3000, 2)  # two-phase put / write-arena put
    with KVStoreClient(addr, object_key=KEY) as c:
        assert c.put("big", big) == Status.OK and c.put("small", small) == Status.OK
        for key, src in (("big", big), ("small", small)):
            assert _replica(addr, key).mac == object_mac(KEY, key, memoryview(src))
            out = np.zeros_like(src)
            assert c.get(key, out) == src.nbytes and np.array_equal(out, src)
            assert c.get_bytes(key) == src.tobytes()
        for key, at in (("big", 12345), ("small", 7)):
            _flip_stored_byte(addr, key, at)
            with pytest.raises(KVStoreError) as info:
                c.get(key, np.zeros(1 << 20, dtype=np.uint8))
            assert key in info.value.failed
            with pytest.raises(KVStoreError, match="MAC mismatch"):
                c.get_bytes(key)
        assert c.counters["mac_mismatches"] == 4
    with KVStoreClient(addr, object_key=KEY, use_shm=False) as tcp:  # the TCP read path checks too
        with pytest.raises(KVStoreError):
            tcp.get("big", np.zeros(1 << 20, dtype=np.uint8))


def test_an_object_without_a_mac_is_refused_by_a_reader_with_a_key(procs) -> None:
    addr = _start(procs)
    src = _blob(5000, 3)
    with KVStoreClient(addr) as writer:  # no store key: a writer outside the worker set
        assert writer.put("unsigned", src) == Status.OK
    with KVStoreClient(addr, object_key=KEY) as reader, pytest.raises(KVStoreError):
        reader.get("unsigned", np.zeros_like(src))
    with KVStoreClient(addr, object_key=secrets.token_bytes(32)) as other:  # another cluster's key
        with KVStoreClient(addr, object_key=KEY) as writer:
            assert writer.put("signed", src) == Status.OK
        with pytest.raises(KVStoreError):
            other.get("signed", np.zeros_like(src))


def test_the_mac_survives_a_snapshot() -> None:
    cfg = MasterConfig()
    store = MetadataStore(cfg)
    store.mount("n0", "127.0.0.1", 9, "h", [(1, 1 << 20, "", 1)], 0)
    _, obj = store.put_start("k", 100, 1, False, 0)
    mac = object_mac(KEY, "k", memoryview(bytes(100)))
    assert store.put_end("k", obj.put_id, 0, mac) == Status.OK
    _, arena = store.arena_reserve(4096, 1, 0)
    assert store.arena_commit(arena.arena_id, [("a", 0, 10, b"m" * 32)], False, 0)[1] == [Status.OK]
    again = MetadataStore(cfg)
    load_snapshot(again, snapshot_state(store), 0)
    assert again.objects["k"].mac == mac and again.objects["a"].mac == b"m" * 32
