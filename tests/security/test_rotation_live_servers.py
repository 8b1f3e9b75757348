"""Key rotation reaches the real ZMQ servers (issue 16, item 7): the P2P side channel and the
worker's KV-event snapshot socket follow their key folder (KeyDirWatcher). After `keys revoke`
the old key's live session is no longer served and its new handshake is refused, both counted;
the rotated key is served. Waits end on conditions (the watcher's poll), never fixed sleeps."""

from __future__ import annotations

import pathlib
import time
from typing import Any

import pytest
import torch
import zmq

from pdcluster.connectors.p2p.agent import ProducerAgent
from pdcluster.connectors.p2p.blocks import CacheGeometry
from pdcluster.connectors.p2p.options import P2POptions
from pdcluster.connectors.p2p.peer import ChannelPool, LoadError, Producer, call
from pdcluster.connectors.p2p.side_channel import SideChannelServer
from pdcluster.connectors.p2p.wire import HEARTBEAT
from pdcluster.security.curve import make_client_socket
from pdcluster.security.keys import init_keys, load_keypair, revoke_old_key, rotate_key
from pdcluster.transfer import Region

DEADLINE_S = 60.0
REF = {"lease_id": "1" * 32, "transfer_id": "a" * 32}
GEO = CacheGeometry(num_layers=2, num_blocks=8, block_nbytes=1024)
FP = {"model": "m", "dtype": "float32", "kv_dtype": "float32", "num_layers": 2, "num_kv_heads": 2, "head_dim": 64,
      "block_size": 4, "layout": "NHD", "connector_version": 1, "body_version": 1}


def _wait(cond, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _revoke(keys: pathlib.Path, auth: Any, socks: list[zmq.Socket], name: str) -> None:
    """keys rotate + keys revoke, then wait until the server's own poll took the old key off
    every socket's allow-list (an earlier poll may have seen only the rotate step)."""
    old_key = load_keypair(keys, name).public
    rotate_key(keys, name)
    revoke_old_key(keys, name)
    _wait(lambda: all(old_key not in auth._domains[s.zap_domain.decode()].keys for s in socks),
          "the key folder to be re-read")


@pytest.fixture()
def p2p(tmp_path: pathlib.Path):
    keys = tmp_path / "keys"
    init_keys(keys, ["prefill-0", "decode-0"])
    opts = P2POptions.from_dict({"keys_dir": str(keys), "key_name": "prefill-0"},
                                type("E", (), {"kv_role": "producer"})())
    assert opts.keys_dir == str(keys)
    agent = ProducerAgent(opts, FP, GEO, Region.from_buffer(torch.zeros(GEO.nbytes // 4)), None)
    side = SideChannelServer(agent, opts)
    yield keys, side, Producer("p", side.endpoint, opts.keypair.public)
    side.close()
    agent.close()


def _consumer(keys: pathlib.Path, name: str) -> ChannelPool:
    kp = load_keypair(keys, name)
    return ChannelPool(P2POptions(engine_id=f"c-{name}", kv_role="consumer", keypair=kp,
                                  allowed_keys={kp.name: kp.public}, request_timeout_s=2.0))


def test_p2p_side_channel_follows_revocation(p2p) -> None:
    keys, side, prod = p2p
    old = _consumer(keys, "decode-0")
    try:
        assert call(old, prod, HEARTBEAT, {"leases": [REF]})["alive"] == []  # a live session
        _revoke(keys, side.auth, [side.sock], "decode-0")
        with pytest.raises(LoadError):  # the live session's request is dropped, not served
            call(old, prod, HEARTBEAT, {"leases": [REF]})
        assert side.auth.metrics.value("p2p-side-channel", "session_revoked") == 1
        with pytest.raises(LoadError):  # and a new handshake with the old key is refused
            call(old, prod, HEARTBEAT, {"leases": [REF]})
        _wait(lambda: side.auth.metrics.value("p2p-side-channel", "key_not_allowed") >= 1, "the refusal count")
        new = _consumer(keys, "decode-0")  # the rotated pair (now named decode-0) is served
        try:
            assert call(new, prod, HEARTBEAT, {"leases": [REF]})["alive"] == []
        finally:
            new.close()
    finally:
        old.close()


def test_kv_snapshot_socket_follows_revocation(tmp_path: pathlib.Path) -> None:
    from pdcluster.worker.kv_events import KVEventsConfig, KVEventService
    from pdcluster.worker.kv_events_pub import decode_snapshot, encode_snapshot_request

    keys = tmp_path / "keys"
    init_keys(keys, ["router", "worker", "client"])
    config = KVEventsConfig.from_key_dir(keys, key_name="worker", allow_names=("router",))
    service = KVEventService(None, config, "w0", epoch=1)  # type: ignore[arg-type]  # no engine: not started
    pub = service.publisher
    ctx = zmq.Context()
    socks: list[zmq.Socket] = []

    def dealer(name: str) -> zmq.Socket:
        s = make_client_socket(ctx, zmq.DEALER, load_keypair(keys, name), pub.public_key, pub.snapshot_endpoint)
        socks.append(s)
        return s

    def ask(s: zmq.Socket, rid: int) -> bool:
        s.send(encode_snapshot_request("w0", rid))
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            pub.serve_snapshots(timeout_ms=50)
            if s.poll(0):
                return decode_snapshot(s.recv()).request_id == rid
        return False

    try:
        old = dealer("router")
        assert ask(old, 1)
        client = dealer("client")  # in the folder, but not a subscriber by name: `only` keeps it out
        assert not ask(client, 2)
        _revoke(keys, service._auth, list(pub.server_sockets), "router")
        assert not ask(old, 3)
        assert pub.num_revoked_requests >= 1
        assert service.refusals.value("kv_snapshot", "session_revoked") >= 1
        assert ask(dealer("router"), 4)  # the rotated router key
    finally:
        for s in socks:
            s.close(linger=0)
        ctx.term()
        import asyncio

        asyncio.run(service.close())


def test_kv_events_pub_closes_revoked_subscription(tmp_path: pathlib.Path) -> None:
    """A PUB socket receives nothing to drop, so revocation replaces it: the revoked router's
    live subscription ends (it gets no batch published after the swap, and its reconnect is
    refused and counted) while the other router reconnects and keeps receiving."""
    import asyncio

    from pdcluster.engine.block_pool import BlockStored
    from pdcluster.worker.kv_events import KVEventsConfig, KVEventService
    from pdcluster.worker.kv_events_pub import decode_batch

    keys = tmp_path / "keys"
    init_keys(keys, ["router", "router-b", "worker"])
    config = KVEventsConfig.from_key_dir(keys, key_name="worker", allow_names=("router", "router-b"))
    service = KVEventService(None, config, "w0", epoch=1)  # type: ignore[arg-type]  # driven by hand
    pub = service.publisher
    endpoint = pub.events_endpoint
    ctx = zmq.Context()
    subs: dict[str, zmq.Socket] = {}
    seen: dict[str, list[int]] = {"router": [], "router-b": [], "rotated": []}

    def subscribe(label: str, key_name: str) -> None:
        s = make_client_socket(ctx, zmq.SUB, load_keypair(keys, key_name), pub.public_key, endpoint)
        s.subscribe(b"")
        subs[label] = s

    def pump(n: int = 1) -> None:
        # One tick of the service as its event-loop task would run it, then read every SUB.
        service.apply_revocations()
        pub.publish([BlockStored((bytes([n % 256]) * 8,), None)])
        for label, s in subs.items():
            while s.poll(20):
                seen[label].append(decode_batch(s.recv()).seq)

    try:
        subscribe("router", "router")
        subscribe("router-b", "router-b")
        _wait(lambda: (pump(), seen["router"] and seen["router-b"])[1], "both subscribers to hear batches")
        rotate_key(keys, "router")
        revoke_old_key(keys, "router")
        _wait(lambda: (pump(), pub.num_reopens == 1)[1], "the PUB socket to be replaced")
        assert pub.events_endpoint == endpoint  # same endpoint: subscribers need no new address
        swapped_at = pub.seq  # batches after this went out on the new socket only
        count = len(seen["router-b"])
        _wait(lambda: (pump(), len([q for q in seen["router-b"][count:] if q > swapped_at]) >= 3)[1],
              "the allowed router to reconnect and hear new batches")
        _wait(lambda: (pump(), service.refusals.value("kv_events", "key_not_allowed") >= 1)[1],
              "the revoked router's reconnect to be refused")
        assert not [q for q in seen["router"] if q > swapped_at], "revoked subscription still live"
        assert service.refusals.value("kv_events", "revoked_sessions_closed") == 1
        subscribe("rotated", "router")  # the rotated pair (now named router) is served
        _wait(lambda: (pump(), seen["rotated"])[1], "the rotated router key to hear batches")
        assert not [q for q in seen["router"] if q > swapped_at]
    finally:
        for s in subs.values():
            s.close(linger=0)
        ctx.term()
        asyncio.run(service.close())
