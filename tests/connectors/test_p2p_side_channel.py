"""The P2P producer's side channel and data plane under hostile input: refused peers, malformed
and replayed frames, capabilities used outside their request, expired leases. After each abuse
the agent must still serve an honest consumer."""

from __future__ import annotations

import time
from typing import Any

import msgpack
import pytest
import torch
import zmq

from pdcluster.connectors.p2p.agent import ProducerAgent
from pdcluster.connectors.p2p.blocks import CacheGeometry, block_ranges
from pdcluster.connectors.p2p.options import P2POptions
from pdcluster.connectors.p2p.peer import ChannelPool, HandshakeCache, LoadError, Producer, call
from pdcluster.connectors.p2p.scatter_reader import ScatterReader
from pdcluster.connectors.p2p.side_channel import SideChannelServer
from pdcluster.connectors.p2p.wire import DONE, OPEN, REPLIES, new_nonce, now_ms
from pdcluster.security.envelope import decode, encode
from pdcluster.security.keys import generate_keypair
from pdcluster.transfer import Region, TransferError

GEO = CacheGeometry(num_layers=2, num_blocks=8, block_nbytes=1024)
FP = {"model": "m", "dtype": "float32", "kv_dtype": "float32", "num_layers": 2, "num_kv_heads": 2, "head_dim": 64,
      "block_size": 4, "layout": "NHD", "connector_version": 1, "body_version": 1}
PRODUCER, CONSUMER, STRANGER = (generate_keypair(n) for n in ("producer", "consumer", "stranger"))


def _opts(kp: Any, role: str, **kw: Any) -> P2POptions:
    allowed = {"producer": PRODUCER.public, "consumer": CONSUMER.public}
    return P2POptions(engine_id=f"test-{role}", kv_role=role, keypair=kp, allowed_keys=allowed, **kw)


@pytest.fixture()
def agent() -> Any:
    cache = torch.arange(GEO.nbytes // 4, dtype=torch.float32)  # distinct bytes everywhere
    opts = _opts(PRODUCER, "producer", lease_ttl_s=30.0)
    a = ProducerAgent(opts, FP, GEO, Region.from_buffer(cache), None)
    side = SideChannelServer(a, opts)
    a.add_lease("req-a", "a" * 32, "1" * 32, [0, 1, 2])
    a.add_lease("req-b", "b" * 32, "2" * 32, [5, 6])
    yield a, side, Producer("test-producer", side.endpoint, PRODUCER.public), cache
    side.close()
    a.close()


@pytest.fixture()
def pool() -> Any:
    p = ChannelPool(_opts(CONSUMER, "consumer", request_timeout_s=2.0))
    yield p
    p.close()


def _open(pool: ChannelPool, producer: Producer, rid: str, tid: str, lease: str) -> dict[str, Any]:
    return call(pool, producer, OPEN, {"request_id": rid, "transfer_id": tid, "lease_id": lease, "first_block": 0})


def _assert_healthy(pool: ChannelPool, producer: Producer) -> None:
    hs = HandshakeCache(pool, _opts(CONSUMER, "consumer"), FP).get(producer, 0, refresh=True)
    assert hs.body["producer_id"] == "test-producer"
    assert _open(pool, producer, "req-a", "a" * 32, "1" * 32)["ok"]


def _raw(endpoint: str, frames: list[bytes], *, kp: Any = CONSUMER, server_key: bytes | None = None,
         curve: bool = True, timeout_ms: int = 1500) -> list[bytes] | None:
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    if curve:
        s.curve_secretkey, s.curve_publickey = kp.secret, kp.public
        s.curve_serverkey = server_key or PRODUCER.public
    s.connect(endpoint)
    try:
        s.send_multipart(frames)
        return s.recv_multipart() if s.poll(timeout_ms) else None
    finally:
        s.close()


def _error(reply: list[bytes] | None) -> str:
    assert reply is not None and len(reply) == 2
    body = decode(REPLIES, reply[1])[1]
    assert body["ok"] is False
    return body["error"]


@pytest.mark.parametrize("peer", ["plaintext", "unknown_key", "wrong_server_key"])
def test_unauthenticated_peers_are_refused(agent: Any, pool: ChannelPool, peer: str) -> None:
    a, side, producer, cache = agent
    msg = encode(OPEN, {"nonce": new_nonce(), "ts_ms": now_ms(), "request_id": "req-a", "transfer_id": "a" * 32,
                        "lease_id": "1" * 32, "first_block": 0})
    kw: dict[str, Any] = {"plaintext": {"curve": False}, "unknown_key": {"kp": STRANGER},
                          "wrong_server_key": {"server_key": STRANGER.public}}[peer]
    assert _raw(side.endpoint, [msg], **kw) is None  # no session, no answer, no token
    deadline = time.monotonic() + 5
    while side.refusals() == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert side.refusals() >= 1 or peer == "wrong_server_key"  # a bad server key may fail client-side only
    _assert_healthy(pool, producer)


def test_garbage_truncated_oversize_multiframe_and_replayed_frames(agent: Any, pool: ChannelPool) -> None:
    a, side, producer, cache = agent
    good = encode(OPEN, {"nonce": new_nonce(), "ts_ms": now_ms(), "request_id": "req-a", "transfer_id": "a" * 32,
                         "lease_id": "1" * 32, "first_block": 0})
    assert "malformed" in _error(_raw(side.endpoint, [b"\x00\xffnot msgpack at all"]))
    assert "malformed" in _error(_raw(side.endpoint, [good[: len(good) // 2]]))
    assert "malformed" in _error(_raw(side.endpoint, [msgpack.packb({"type": "p2p_open", "v": 1, "body": {}})]))
    assert "malformed" in _error(_raw(side.endpoint, [b"\x91" + b"\xc4" * 2]))
    assert "malformed" in _error(_raw(side.endpoint, [b"x" * (100 << 10)]))  # over the decode bound
    assert _raw(side.endpoint, [b"x" * (2 << 20)]) is None  # over MAXMSGSIZE: dropped by ZMQ
    assert "expected one frame" in _error(_raw(side.endpoint, [good, good]))
    first = _raw(side.endpoint, [good])
    assert first is not None and decode(REPLIES, first[1])[1]["ok"]
    assert "replayed" in _error(_raw(side.endpoint, [good]))
    stale = encode(OPEN, {"nonce": new_nonce(), "ts_ms": now_ms() - 3_600_000, "request_id": "req-a",
                          "transfer_id": "a" * 32, "lease_id": "1" * 32, "first_block": 0})
    assert "off" in _error(_raw(side.endpoint, [stale]))
    counters = a.stats()
    assert counters["p2p_refused_malformed"] >= 5 and counters["p2p_refused_replayed"] == 2
    _assert_healthy(pool, producer)


def test_capabilities_are_bound_to_their_request(agent: Any, pool: ChannelPool) -> None:
    a, side, producer, cache = agent
    assert "wrong_request" in _open(pool, producer, "req-b", "a" * 32, "1" * 32)["error"]
    assert "wrong_transfer" in _open(pool, producer, "req-a", "b" * 32, "1" * 32)["error"]
    assert "unknown" in _open(pool, producer, "req-a", "a" * 32, "9" * 32)["error"]
    assert call(pool, producer, DONE, {"request_id": "req-b", "transfer_id": "a" * 32, "lease_id": "1" * 32,
                                       "ok": True})["status"] == "wrong_request"
    # Data plane: request a's token is useless for request b's blocks (and for forged bytes).
    reply_a = _open(pool, producer, "req-a", "a" * 32, "1" * 32)
    host, port = a.server.address
    dest = memoryview(bytearray(8 * GEO.block_nbytes))  # 2 layers x K,V x 2 blocks
    b_ranges = block_ranges(GEO, [5, 6])
    reader = ScatterReader(num_streams=2, min_stream_bytes=1024)
    try:
        with pytest.raises(TransferError, match="unauthorized"):
            reader.read((host, port), reply_a["tokens"][0], b_ranges, dest, [(0, dest.nbytes)])
        forged = bytearray(reply_a["tokens"][0])
        forged[-1] ^= 1
        a_ranges = block_ranges(GEO, [0, 1, 2])
        dest6 = memoryview(bytearray(sum(n for _, n in a_ranges)))
        with pytest.raises(TransferError, match="unauthorized"):
            reader.read((host, port), bytes(forged), a_ranges, dest6, [(0, dest6.nbytes)])
        # The honest read returns exactly a's blocks.
        reader.read((host, port), reply_a["tokens"][0], a_ranges, dest6, [(0, dest6.nbytes)])
        src = memoryview(cache.numpy().view("uint8"))
        assert bytes(dest6) == b"".join(bytes(src[o:o + n]) for o, n in a_ranges)
    finally:
        reader.close()


def test_expired_lease_is_an_error_to_the_reader(pool: ChannelPool) -> None:
    cache = torch.zeros(GEO.nbytes // 4)
    opts = _opts(PRODUCER, "producer", lease_ttl_s=2.0)  # time for the open below on a slow machine
    a = ProducerAgent(opts, FP, GEO, Region.from_buffer(cache), None)
    side = SideChannelServer(a, opts)
    producer = Producer("test-producer", side.endpoint, PRODUCER.public)
    reader = ScatterReader(num_streams=1, min_stream_bytes=1024)
    try:
        a.add_lease("req-x", "c" * 32, "3" * 32, [4])
        reply = _open(pool, producer, "req-x", "c" * 32, "3" * 32)
        assert reply["ok"]
        time.sleep(2.3)  # past the lease's end (expiry is checked against the clock when used)
        ranges = block_ranges(GEO, [4])
        dest = memoryview(bytearray(sum(n for _, n in ranges)))
        with pytest.raises(TransferError, match="expired"):  # the token died with the lease
            reader.read(a.server.address, reply["tokens"][0], ranges, dest, [(0, dest.nbytes)])
        assert "expired" in _open(pool, producer, "req-x", "c" * 32, "3" * 32)["error"]
        done = call(pool, producer, DONE, {"request_id": "req-x", "transfer_id": "c" * 32, "lease_id": "3" * 32,
                                           "ok": True})
        assert done["status"] == "expired" and not done["ok"]
        assert a.leases.take_finished() == {"req-x"}  # freed exactly once
    finally:
        reader.close()
        side.close()
        a.close()


def test_incompatible_fingerprint_is_refused_before_the_body(agent: Any, pool: ChannelPool) -> None:
    _, _, producer, _ = agent
    other = dict(FP, block_size=8)
    with pytest.raises(LoadError, match="block_size"):
        HandshakeCache(pool, _opts(CONSUMER, "consumer"), other).get(producer, 0)
