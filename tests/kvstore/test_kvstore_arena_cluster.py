"""One-RPC puts through write arenas, and token-free shared-memory gets, with real master/node
processes on 127.0.0.1 (the client runs in the test process)."""

from __future__ import annotations

import os
import threading
import time

import numpy as np

from pdcluster._proto import kvstore_pb2 as pb
from pdcluster._proto import kvstore_pb2_grpc as pb_grpc
from pdcluster.kvstore import KVStoreClient, KVStoreError, Status
from pdcluster.kvstore.rpc import make_channel
from pdcluster.transfer import TransferClient, local_host_id
from pdcluster.transfer.region import shm_dir


def blob(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def replicas(addr: str, keys: list[str], shm_host_id: str = "") -> list:
    with make_channel(addr) as ch:
        req = pb.KVGetReplicasRequest(keys=keys, shm_host_id=shm_host_id)
        return list(pb_grpc.KVStoreMasterStub(ch).GetReplicas(req).results)


def start(procs, *master_args: str, nodes: int = 2, size: str = "64M") -> str:
    _, addr = procs.master("--port", "0", *master_args)
    for i in range(nodes):
        procs.node(addr, f"n{i}", size)
    deadline = time.monotonic() + 60  # process start on a slow machine
    with KVStoreClient(addr) as c:
        while c.stats()["nodes"] < nodes:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    return addr


def test_small_objects_take_one_rpc_and_read_back_byte_exact(procs) -> None:
    addr = start(procs)
    objs = {f"small/{i}": blob(1000 + 97 * i, i) for i in range(160)}
    keys = list(objs)
    with KVStoreClient(addr) as c:
        for a in range(0, len(keys), 16):
            assert c.batch_put(keys[a:a + 16], [objs[k] for k in keys[a:a + 16]]) == [Status.OK] * 16
        st = c.stats()
        assert st["arena_objects"] == 160 and st.get("puts_started", 0) == 0  # not one PutStart
        assert st["arenas_reserved"] == 1 and st["arenas"] == 1
        dests = [np.zeros(objs[k].nbytes, dtype=np.uint8) for k in keys]
        assert c.batch_get(keys, dests) == [objs[k].nbytes for k in keys]
        assert all(np.array_equal(d, objs[k]) for k, d in zip(keys, dests, strict=True))
        assert c.batch_put(keys[:3], [objs[k] for k in keys[:3]]) == [Status.ALREADY_EXISTS] * 3
        big = blob(3 << 20, 99)  # bigger than arena_max_object: two-phase
        assert c.put("big", big) == Status.OK and c.stats()["puts_started"] == 1
        # Two replicas: a second arena; every replica holds the bytes (read each one over TCP).
        two = [blob(5000 + i, 200 + i) for i in range(8)]
        assert c.batch_put([f"two/{i}" for i in range(8)], two, replica_num=2) == [Status.OK] * 8
        assert c.stats()["arenas_reserved"] == 2
    with KVStoreClient(addr, use_shm=False) as tcp:  # the closed client handed its arenas back
        st = tcp.stats()
        assert st["arenas"] == 0 and st["arenas_released"] == 2
        xfer = TransferClient(num_streams=1)
        try:
            for i, res in enumerate(replicas(addr, [f"two/{i}" for i in range(8)])):
                assert sorted(r.node_id for r in res.replicas) == ["n0", "n1"]
                for r in res.replicas:
                    out = np.zeros(r.size, dtype=np.uint8)
                    xfer.read((r.data_host, r.data_port), r.token, [(r.offset, r.size)], memoryview(out))
                    assert np.array_equal(out, two[i])
        finally:
            xfer.close()
        # A TCP-only client never uses arenas (the data plane stays token-checked).
        assert tcp.batch_put(["tcp/0", "tcp/1"], [blob(100, 1), blob(200, 2)]) == [Status.OK] * 2
        st = tcp.stats()
        assert st["arenas_reserved"] == 2 and st["puts_started"] == 3


def test_concurrent_batch_puts_from_threads_of_one_client(procs) -> None:
    addr = start(procs, nodes=1)
    threads, rounds, batch = 6, 12, 16
    data = {f"t{t}/{r}/{j}": blob(16 << 10, t * 10_000 + r * 100 + j)
            for t in range(threads) for r in range(rounds) for j in range(batch)}
    errors: list[BaseException] = []
    with KVStoreClient(addr, arena_bytes=1 << 20) as c:  # small arenas: threads cross arena ends often
        barrier = threading.Barrier(threads)

        def work(t: int) -> None:
            try:
                barrier.wait()
                for r in range(rounds):
                    keys = [f"t{t}/{r}/{j}" for j in range(batch)]
                    assert c.batch_put(keys, [data[k] for k in keys]) == [Status.OK] * batch
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                errors.append(e)

        ts = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not errors, errors
        st = c.stats()
        assert st["arena_objects"] == len(data) and st.get("puts_started", 0) == 0
        assert st["arenas_reserved"] >= len(data) * (16 << 10) // (1 << 20)
        keys = list(data)
        dests = [np.zeros(16 << 10, dtype=np.uint8) for _ in keys]
        assert c.batch_get(keys, dests) == [16 << 10] * len(keys)
        assert all(np.array_equal(d, data[k]) for k, d in zip(keys, dests, strict=True))
        extents = sorted((r.offset, r.offset + r.size) for res in replicas(addr, keys) for r in res.replicas)
        assert all(a[1] <= b[0] for a, b in zip(extents, extents[1:], strict=False))  # no two objects overlap


def test_two_clients_putting_one_key_through_arenas_exactly_one_wins(procs) -> None:
    addr = start(procs, nodes=1)
    clients = [KVStoreClient(addr) for _ in range(5)]
    try:
        for c in clients:  # every client holds an arena first, so the race is between CommitArenas
            assert c.put(f"warm/{id(c)}", b"w" * 10) == Status.OK
        results: dict[int, Status] = {}
        barrier = threading.Barrier(len(clients))

        def put(i: int) -> None:
            barrier.wait()
            results[i] = clients[i].put("contended", blob(64 << 10, 100 + i))

        ts = [threading.Thread(target=put, args=(i,)) for i in range(len(clients))]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        winners = [i for i, st in results.items() if st == Status.OK]
        assert len(winners) == 1 and all(st == Status.ALREADY_EXISTS for i, st in results.items() if i != winners[0])
        out = np.zeros(64 << 10, dtype=np.uint8)
        assert clients[0].get("contended", out) == 64 << 10 and np.array_equal(out, blob(64 << 10, 100 + winners[0]))
        st = clients[0].stats()
        assert st.get("puts_started", 0) == 0 and st["arenas_reserved"] == len(clients)
    finally:
        for c in clients:
            c.close()


def test_arenas_expire_and_are_replaced_while_putting(procs) -> None:
    addr = start(procs, "--put-timeout-s", "1.2", "--grace-s", "0.1", nodes=1)
    with KVStoreClient(addr) as c:
        # A client uses an arena for the first half of its life (0.6 s), then reserves another:
        # put until four were reserved and two expired (about 2 s), however long each put takes.
        deadline = time.monotonic() + 60
        i = 0
        while True:
            assert c.put(f"e/{i}", blob(4096, i)) == Status.OK
            i += 1
            st = c.stats()
            if (st.get("arenas_reserved", 0) >= 4 and st.get("arenas_expired", 0) >= 2) or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert st["arenas_reserved"] >= 4 and st["arenas_expired"] >= 2 and st.get("puts_started", 0) == 0
        out = np.zeros(4096, dtype=np.uint8)
        for k in (0, i // 2, i - 1):
            assert c.get(f"e/{k}", out) == 4096 and np.array_equal(out, blob(4096, k))


def test_master_restart_keeps_the_arena_and_its_objects(procs) -> None:
    port = str(procs.free_port())
    args = ("--port", port, "--data-dir", os.path.join(procs.tmp, "master"), "--put-timeout-s", "30")
    master, addr = procs.master(*args)
    procs.node(addr, "n0", "64M")
    with KVStoreClient(addr) as c:
        deadline = time.monotonic() + 60  # process start on a slow machine
        while c.stats()["nodes"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        first = [blob(3000, i) for i in range(16)]
        assert c.batch_put([f"r/{i}" for i in range(16)], first) == [Status.OK] * 16
        procs.kill(master)
        procs.master(*args)
        deadline = time.monotonic() + 60  # process start on a slow machine
        while True:  # the client's channel reconnects on its own
            try:
                c.stats()
                break
            except KVStoreError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        # Same arena (replayed from the op log), so still no reservation and no two-phase put.
        second = [blob(3000, 100 + i) for i in range(16)]
        assert c.batch_put([f"s/{i}" for i in range(16)], second) == [Status.OK] * 16
        st = c.stats()
        assert st["arenas"] == 1 and st.get("arenas_reserved", 0) == 0 and st["arena_objects"] == 16
        assert st.get("puts_started", 0) == 0
        keys = [f"r/{i}" for i in range(16)] + [f"s/{i}" for i in range(16)]
        dests = [np.zeros(3000, dtype=np.uint8) for _ in keys]
        assert c.batch_get(keys, dests) == [3000] * 32
        assert all(np.array_equal(d, s) for d, s in zip(dests, first + second, strict=True))


def test_gets_through_shared_memory_need_no_tokens_and_fall_back_to_tcp(procs) -> None:
    addr = start(procs, nodes=1)
    data = blob(50_000, 7)
    with KVStoreClient(addr) as c:
        assert c.put("k", data) == Status.OK
    (res,) = replicas(addr, ["k"], shm_host_id=local_host_id())
    assert res.status == Status.OK and res.replicas[0].shm_name and res.replicas[0].token == b""
    (res,) = replicas(addr, ["k"], shm_host_id="some-other-host")
    assert len(res.replicas[0].token) > 0
    # The segment disappears from /dev/shm (the node keeps its mapping): the client's shm copy
    # fails, it asks again with tokens and reads over TCP.
    os.unlink(os.path.join(shm_dir(), res.replicas[0].shm_name))
    with KVStoreClient(addr) as c:
        out = np.zeros_like(data)
        assert c.get("k", out) == data.nbytes and np.array_equal(out, data)
        assert c.get_bytes("k") == data.tobytes()
        # Our two GetReplicas above, the get that asked twice, then get_bytes asked with tokens at once.
        assert c.stats()["hits"] == 5


def test_a_lost_arena_falls_back_to_two_phase_puts(procs) -> None:
    port = str(procs.free_port())
    master, addr = procs.master("--port", port)  # no op log: a restart forgets every arena
    procs.node(addr, "n0", "64M")
    with KVStoreClient(addr) as c:
        deadline = time.monotonic() + 60  # process start on a slow machine
        while c.stats()["nodes"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert c.batch_put(["a/0", "a/1"], [blob(2000, 0), blob(2000, 1)]) == [Status.OK] * 2
        procs.kill(master)
        procs.master("--port", port)
        while True:  # wait for the client's channel and the node's re-mount
            try:
                if c.stats()["nodes"] == 1:
                    break
            except KVStoreError:
                pass
            assert time.monotonic() < deadline + 10
            time.sleep(0.1)
        data = [blob(3000, 10 + i) for i in range(4)]
        # The commit into the forgotten arena fails (NOT_FOUND): the client puts them two-phase.
        assert c.batch_put([f"b/{i}" for i in range(4)], data) == [Status.OK] * 4
        st = c.stats()
        assert st["puts_started"] == 4 and st.get("arena_objects", 0) == 0
        # ... and the next batch reserves a fresh arena again.
        assert c.put("c/0", blob(100, 20)) == Status.OK and c.stats()["arena_objects"] == 1
        dests = [np.zeros(3000, dtype=np.uint8) for _ in data]
        assert c.batch_get([f"b/{i}" for i in range(4)], dests) == [3000] * 4
        assert all(np.array_equal(d, s) for d, s in zip(dests, data, strict=True))
