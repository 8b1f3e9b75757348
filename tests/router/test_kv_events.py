"""KV events: wire format, the pure tracker (gaps, epochs, snapshot resync), and the CURVE
publisher/subscriber pair end to end."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq

from pdcluster.router.kv_events import EventStreamTracker, KVEventSubscriber
from pdcluster.router.prefix_index import PrefixIndex
from pdcluster.security.curve import CurveAuthenticator
from pdcluster.security.envelope import MalformedMessage
from pdcluster.security.keys import generate_keypair
from pdcluster.worker.kv_events_pub import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventPublisher,
    KVSnapshot,
    decode_batch,
    decode_snapshot,
    decode_snapshot_request,
    encode_batch,
    encode_snapshot,
    encode_snapshot_request,
)


def h(*ids: int) -> tuple[bytes, ...]:
    return tuple(f"block-{i}".encode() for i in ids)


def batch(seq: int, *events, epoch: int = 1, pub: str = "w0") -> KVEventBatch:
    return KVEventBatch(pub, epoch, seq, tuple(events), ts=123.0)


# -- wire ---------------------------------------------------------------------------------------
def test_batch_and_snapshot_roundtrip():
    b = batch(3, BlockStored(h(1, 2), parent_hash=h(0)[0]), BlockRemoved(h(0)), AllBlocksCleared())
    assert decode_batch(encode_batch(b)) == b
    s = KVSnapshot("w0", 5, 9, h(1, 2, 3), request_id=4)
    assert decode_snapshot(encode_snapshot(s)) == s
    assert decode_snapshot_request(encode_snapshot_request("w0", 4)) == ("w0", 4)


@pytest.mark.parametrize(
    "body",
    [
        {"publisher_id": "w0", "epoch": 1, "seq": 1, "events": [{"kind": "exploded"}]},
        {"publisher_id": "w0", "epoch": 1, "seq": 1, "events": [{"kind": "stored", "block_hashes": ["str"]}]},
        {"publisher_id": "w0", "epoch": 1, "seq": 1, "events": [{"kind": "stored", "block_hashes": [b"x" * 65]}]},
        {"publisher_id": "w0", "epoch": 1, "seq": -1, "events": []},
        {"publisher_id": "", "epoch": 1, "seq": 1, "events": []},
        {"publisher_id": "w0", "epoch": 1, "seq": 1},
    ],
)
def test_malformed_batches(body):
    data = msgpack.packb({"type": "kv_event_batch", "v": 1, "body": body}, use_bin_type=True)
    with pytest.raises(MalformedMessage):
        decode_batch(data)


def test_wrong_message_type_is_malformed():
    with pytest.raises(MalformedMessage):
        decode_batch(encode_snapshot_request("w0", 1))


# -- tracker ------------------------------------------------------------------------------------
@pytest.fixture
def tracker():
    return EventStreamTracker(PrefixIndex(), "w0", max_buffered=4)


def held(t: EventStreamTracker) -> set[bytes]:
    return set(t.index.block_hashes("w0"))


def test_in_order_batches_apply(tracker):
    assert tracker.apply(batch(1, BlockStored(h(1, 2, 3)))).kind == "applied"
    assert tracker.apply(batch(2, BlockRemoved(h(2)))).kind == "applied"
    assert held(tracker) == set(h(1, 3))
    assert tracker.apply(batch(2, BlockStored(h(9)))).kind == "ignored"  # duplicate
    assert tracker.apply(batch(2)).reason == "heartbeat"
    assert tracker.apply(batch(3, AllBlocksCleared())).kind == "applied"
    assert held(tracker) == set()


def test_gap_requests_snapshot_buffers_and_replays(tracker):
    tracker.apply(batch(1, BlockStored(h(1))))
    action = tracker.apply(batch(4, BlockStored(h(4))))  # 2 and 3 lost
    assert action.needs_snapshot and "gap" in action.reason
    assert tracker.apply(batch(5, BlockRemoved(h(2)))).kind == "buffered"
    assert held(tracker) == set(h(1))  # stale hints kept while resyncing
    # Publisher state at seq 3: blocks 1, 2, 3 (the snapshot may be older than the buffer).
    result = tracker.apply_snapshot(KVSnapshot("w0", 1, 3, h(1, 2, 3)))
    assert result.kind == "applied"
    assert held(tracker) == set(h(1, 3, 4)) and tracker.last_seq == 5 and not tracker.resyncing


def test_snapshot_older_than_buffer_hole_resyncs_again(tracker):
    tracker.apply(batch(1))
    tracker.apply(batch(5, BlockStored(h(5))))
    again = tracker.apply_snapshot(KVSnapshot("w0", 1, 3, h(1)))  # seq 4 still missing
    assert again.needs_snapshot and tracker.resyncing
    assert tracker.apply_snapshot(KVSnapshot("w0", 1, 5, h(1, 5))).kind == "applied"
    assert held(tracker) == set(h(1, 5)) and tracker.num_resyncs == 2


def test_heartbeat_reveals_lost_last_batch(tracker):
    tracker.apply(batch(1, BlockStored(h(1))))
    assert tracker.apply(batch(2)).needs_snapshot  # heartbeat says seq 2 exists; we never saw it


def test_first_contact_mid_stream_resyncs(tracker):
    action = tracker.apply(batch(7, BlockStored(h(7)), epoch=42))
    assert action.needs_snapshot and action.reason == "first contact"
    tracker.apply_snapshot(KVSnapshot("w0", 42, 7, h(1, 7)))
    assert held(tracker) == set(h(1, 7)) and tracker.epoch == 42


def test_new_epoch_from_start_resets(tracker):
    tracker.apply(batch(1, BlockStored(h(1, 2))))
    assert tracker.apply(batch(1, BlockStored(h(9)), epoch=2)).kind == "applied"
    assert held(tracker) == set(h(9)) and tracker.epoch == 2
    tracker2 = EventStreamTracker(PrefixIndex(), "w0")
    assert tracker2.apply(batch(0, epoch=3)).reason == "heartbeat"  # fresh publisher, nothing yet
    assert tracker2.epoch == 3


def test_new_epoch_mid_stream_clears_and_resyncs(tracker):
    tracker.apply(batch(1, BlockStored(h(1, 2))))
    action = tracker.apply(batch(3, BlockStored(h(3)), epoch=2))
    assert action.needs_snapshot and action.reason == "new epoch"
    assert held(tracker) == set()  # the restarted worker's old blocks are gone


def test_stale_snapshot_of_old_epoch_then_newer_buffered_epoch(tracker):
    tracker.apply(batch(1))
    tracker.apply(batch(3, epoch=1))  # gap
    tracker.apply(batch(2, BlockStored(h(2)), epoch=2))  # worker restarted meanwhile
    action = tracker.apply_snapshot(KVSnapshot("w0", 1, 3, h(1)))
    assert action.needs_snapshot  # the epoch-2 batch shows the snapshot is already outdated
    assert held(tracker) == set()


def test_buffer_overflow_drops_oldest_then_resyncs(tracker):
    tracker.apply(batch(1))
    tracker.apply(batch(3))
    for seq in range(4, 10):
        tracker.apply(batch(seq, BlockStored(h(seq))))
    # buffer (4) now holds 6..9; a snapshot at 3 leaves a hole at 4.
    assert tracker.apply_snapshot(KVSnapshot("w0", 1, 3, ())).needs_snapshot


def test_other_publishers_ignored(tracker):
    assert tracker.apply(batch(1, BlockStored(h(1)), pub="w9")).kind == "ignored"
    assert tracker.apply_snapshot(KVSnapshot("w9", 1, 1, h(1))).kind == "ignored"
    assert held(tracker) == set()


# -- end to end over CURVE ----------------------------------------------------------------------
@pytest.fixture
def cluster():
    ctx = zmq.Context()
    auth = CurveAuthenticator(ctx, poll_interval_s=0.02).start()
    worker_kp, router_kp = generate_keypair("worker"), generate_keypair("router")
    blocks: set[bytes] = set()
    pub = KVEventPublisher(ctx, auth, worker_kp, {"router": router_kp.public}, "w0", lambda: sorted(blocks), epoch=7)
    subs: list[KVEventSubscriber] = []
    yield ctx, auth, worker_kp, router_kp, blocks, pub, subs
    for s in subs:
        s.close()
    pub.close()
    auth.stop()
    ctx.term()


def run_until(cond, pub: KVEventPublisher, sub: KVEventSubscriber, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        pub.heartbeat()
        sub.poll(10)
        pub.serve_snapshots(0)
        if cond():
            return True
    return False


def test_late_subscriber_converges_through_snapshot(cluster):
    ctx, auth, worker_kp, router_kp, blocks, pub, subs = cluster
    # Events published before anyone listens are lost (PUB/SUB): the snapshot recovers them.
    blocks.update(h(1, 2))
    pub.publish([BlockStored(h(1, 2))])
    index = PrefixIndex()
    sub = KVEventSubscriber(ctx, router_kp, index, snapshot_timeout_s=1.0)
    subs.append(sub)
    sub.add_publisher("w0", pub.events_endpoint, pub.snapshot_endpoint, pub.public_key)
    assert run_until(lambda: set(index.block_hashes("w0")) == set(h(1, 2)), pub, sub)
    assert sub.tracker("w0").epoch == 7 and sub.tracker("w0").num_resyncs == 1
    blocks.update(h(3))
    pub.publish([BlockStored(h(3))])
    blocks.discard(h(1)[0])
    pub.publish([BlockRemoved(h(1))])
    assert run_until(lambda: set(index.block_hashes("w0")) == set(h(2, 3)), pub, sub)
    assert sub.tracker("w0").last_seq == 3 and sub.num_malformed == 0


def test_subscriber_not_on_allow_list_learns_nothing(cluster):
    ctx, auth, worker_kp, router_kp, blocks, pub, subs = cluster
    index = PrefixIndex()
    sub = KVEventSubscriber(ctx, generate_keypair("intruder"), index)
    subs.append(sub)
    sub.add_publisher("w0", pub.events_endpoint, pub.snapshot_endpoint, pub.public_key)
    blocks.update(h(1))
    end = time.monotonic() + 0.6
    while time.monotonic() < end:
        pub.publish([BlockStored(h(1))])
        sub.poll(10)
        pub.serve_snapshots(0)
    assert index.num_blocks("w0") == 0 and sub.tracker("w0").epoch is None
    assert auth.metrics.value("kv_events", "key_not_allowed") >= 1


def test_split_events_respects_wire_bounds(monkeypatch):
    import pdcluster.worker.kv_events_pub as pubmod

    monkeypatch.setattr(pubmod, "MAX_HASHES_PER_BATCH", 4)
    monkeypatch.setattr(pubmod, "MAX_EVENTS_PER_BATCH", 3)
    events = [BlockStored(h(0, 1, 2, 3, 4, 5), parent_hash=b"p"), BlockRemoved(h(9)), AllBlocksCleared(),
              AllBlocksCleared(), AllBlocksCleared()]
    batches = pubmod.split_events(events)
    assert all(len(b) <= 3 and sum(len(getattr(e, "block_hashes", ())) for e in b) <= 4 for b in batches)
    flat = [e for b in batches for e in b]
    assert flat[0] == BlockStored(h(0, 1, 2, 3), parent_hash=b"p")
    assert flat[1] == BlockStored(h(4, 5), parent_hash=h(3)[0])  # the piece chains on its predecessor
    assert flat[2:] == events[1:]
    assert pubmod.split_events([]) == []
