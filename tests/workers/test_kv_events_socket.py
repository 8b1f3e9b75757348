"""The worker's KV-event sockets: an allow-listed router key gets batches and snapshots; a key
not on the list, a wrong server key, or a plaintext client gets nothing."""

from __future__ import annotations

import time

import pytest
import zmq

from pdcluster._proto import common_pb2, worker_pb2
from pdcluster.security.curve import make_client_socket
from pdcluster.security.keys import generate_keypair, load_keypair
from pdcluster.worker.kv_events_pub import (
    BlockStored,
    decode_batch,
    decode_snapshot,
    encode_snapshot_request,
)

WINDOW_S = 2.5  # > 2 heartbeats (1 s): an allowed subscriber surely hears something


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def _generate(stub, ids: list[int]) -> None:
    req = worker_pb2.WorkerGenerateRequest(prompt_token_ids=ids, sampling_params=common_pb2.SamplingParams(
        temperature=0.0, max_tokens=3, ignore_eos=True))
    list(stub.Generate(req, timeout=30))


def _drain(sock: zmq.Socket, out: list[bytes], wait_ms: int = 20) -> None:
    while sock.poll(wait_ms):
        out.append(sock.recv())
        wait_ms = 0


def test_allowed_key_gets_batches_and_snapshot(worker, stub, key_dir, ctx) -> None:
    router = load_keypair(key_dir, "router")
    server_key = worker.ready["kv_events_public_key"]
    sub = make_client_socket(ctx, zmq.SUB, router, server_key, worker.ready["kv_events_endpoint"])
    sub.subscribe(b"")
    got: list[bytes] = []
    stored: set[bytes] = set()
    end = time.monotonic() + 60
    attempt = 0
    # PUB drops what it sends before the subscription arrives (slow joiner), however long that
    # takes: send fresh prompts (3 full blocks of 16 tokens, stored in the prefix cache) until
    # their events come through.
    while len(stored) < 3 and time.monotonic() < end:
        _generate(stub, [1 + attempt, *range(101, 148)])
        attempt += 1
        _drain(sub, got, 200)
        for batch in map(decode_batch, got):
            assert batch.publisher_id == "w-test" and batch.epoch == worker.ready["epoch"]
            stored.update(h for ev in batch.events if isinstance(ev, BlockStored) for h in ev.block_hashes)
    assert len(stored) >= 3
    seqs = [b.seq for b in map(decode_batch, got)]
    assert seqs == sorted(seqs)

    dealer = make_client_socket(ctx, zmq.DEALER, router, server_key, worker.ready["kv_snapshot_endpoint"])
    dealer.send(encode_snapshot_request("w-test", 7))
    assert dealer.poll(5000), "no snapshot"
    snap = decode_snapshot(dealer.recv())
    assert snap.request_id == 7 and snap.epoch == worker.ready["epoch"] and snap.seq >= max(seqs)
    assert stored <= set(snap.block_hashes)
    stats = stub.Stats(worker_pb2.StatsRequest(), timeout=5)
    assert stats.kv_events_seq >= max(seqs) and stats.kv_events_public_key.decode() == server_key


def test_refused_clients_get_nothing(worker, stub, key_dir, ctx) -> None:
    server_key = worker.ready["kv_events_public_key"]
    events, snapshots = worker.ready["kv_events_endpoint"], worker.ready["kv_snapshot_endpoint"]
    not_allowed = load_keypair(key_dir, "client")  # a real cluster key, but not on the allow-list
    router = load_keypair(key_dir, "router")
    wrong_server = generate_keypair("impostor").public
    subs = {
        "key not allowed": make_client_socket(ctx, zmq.SUB, not_allowed, server_key, events),
        "wrong server key": make_client_socket(ctx, zmq.SUB, router, wrong_server, events),
        "plaintext": ctx.socket(zmq.SUB),
    }
    subs["plaintext"].connect(events)
    dealers = {
        "key not allowed": make_client_socket(ctx, zmq.DEALER, not_allowed, server_key, snapshots),
        "plaintext": ctx.socket(zmq.DEALER),
    }
    dealers["plaintext"].connect(snapshots)
    allowed = make_client_socket(ctx, zmq.SUB, router, server_key, events)
    for s in [*subs.values(), allowed]:
        s.subscribe(b"")
        s.linger = 0
    for d in dealers.values():
        d.linger = 0
        try:
            d.send(encode_snapshot_request("w-test", 1), zmq.NOBLOCK)
        except zmq.Again:
            pass  # nothing connected: exactly what a refused client should see
    received: dict[str, list[bytes]] = {name: [] for name in [*subs, *(f"dealer {n}" for n in dealers), "allowed"]}
    end = time.monotonic() + WINDOW_S
    n = 0
    # At least WINDOW_S, and on until the allowed subscriber has heard something (a slow machine
    # may take longer to connect): the refused ones had as long to receive.
    while time.monotonic() < end or (not received["allowed"] and time.monotonic() < end + 60):
        _generate(stub, [200 + n] * 20)  # fresh blocks: stored events to publish
        n += 1
        for name, s in subs.items():
            _drain(s, received[name])
        for name, d in dealers.items():
            _drain(d, received[f"dealer {name}"])
        _drain(allowed, received["allowed"])
    assert received["allowed"], "the allowed subscriber heard nothing: the test proves nothing"
    for name, msgs in received.items():
        if name != "allowed":
            assert msgs == [], f"{name} received {len(msgs)} messages"
    assert worker.proc.poll() is None
