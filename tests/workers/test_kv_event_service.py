"""KVEventService in-process: engine events are published in order, snapshots hold exactly the
published state, and key configuration fails closed."""

from __future__ import annotations

import asyncio
import pathlib

import pytest
import zmq
from workers.fake_engine import FakeEngine

from pdcluster._proto import worker_pb2
from pdcluster.engine.block_pool import AllBlocksCleared, BlockRemoved, BlockStored
from pdcluster.engine.kv_events_pub import decode_batch, decode_snapshot, encode_snapshot_request
from pdcluster.security.curve import make_client_socket
from pdcluster.security.keys import KeyMaterialError, generate_keypair, init_keys, keypair_to_string
from pdcluster.service.kv_events import ENV_ALLOWED_KEYS, ENV_WORKER_KEY, KVEventsConfig
from pdcluster.service.server import start_worker_server

H = [bytes([i]) * 32 for i in range(4)]


async def _recv(sock: zmq.Socket, timeout_s: float = 5.0) -> bytes:
    for _ in range(int(timeout_s / 0.01)):
        try:
            return sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            await asyncio.sleep(0.01)
    raise TimeoutError("nothing received")


async def _next_batch_with_events(sub: zmq.Socket):
    while True:
        batch = decode_batch(await _recv(sub))
        if batch.events:
            return batch


def test_publish_order_and_snapshot() -> None:
    worker_kp, router_kp = generate_keypair("worker"), generate_keypair("router")
    config = KVEventsConfig(worker_kp, {"router": router_kp.public}, interval_s=0.01, heartbeat_s=0.2)

    async def main():
        engine = FakeEngine()
        server, _ = await start_worker_server(engine, "both", kv_events=config, worker_id="w1", epoch=42)
        ctx = zmq.Context()
        try:
            info = server.servicer.kv_events_info()
            assert info.public_key == worker_kp.public and info.epoch == 42
            sub = make_client_socket(ctx, zmq.SUB, router_kp, worker_kp.public, info.events_endpoint)
            sub.subscribe(b"")
            dealer = make_client_socket(ctx, zmq.DEALER, router_kp, worker_kp.public, info.snapshot_endpoint)
            await _recv(sub)  # a heartbeat: connected
            engine.kv_events = [BlockStored((H[0], H[1]), None), BlockRemoved((H[0],)), BlockStored((H[2],), H[1])]
            batch = await _next_batch_with_events(sub)
            assert batch.publisher_id == "w1" and batch.epoch == 42 and batch.seq == 1 and len(batch.events) == 3
            dealer.send(encode_snapshot_request("w1", 5))
            snap = decode_snapshot(await _recv(dealer))
            assert snap.seq == 1 and set(snap.block_hashes) == {H[1], H[2]}
            engine.kv_events = [AllBlocksCleared(), BlockStored((H[3],), None)]
            assert (await _next_batch_with_events(sub)).seq == 2
            dealer.send(encode_snapshot_request("w1", 6))
            snap = decode_snapshot(await _recv(dealer))
            assert snap.seq == 2 and snap.block_hashes == (H[3],)
            stats = await server.servicer.Stats(worker_pb2.StatsRequest(), None)
            assert stats.kv_events_seq == 2 and stats.kv_events_epoch == 42
            assert stats.kv_events_endpoint == info.events_endpoint
            sub.close()
            dealer.close()
        finally:
            await server.stop(None)
            ctx.term()

    asyncio.run(main())


def test_config_from_key_dir(tmp_path: pathlib.Path) -> None:
    init_keys(tmp_path / "k", ("router", "worker"))
    cfg = KVEventsConfig.from_key_dir(tmp_path / "k")
    assert set(cfg.allowed) == {"router"} and cfg.keypair.has_secret
    with pytest.raises(KeyMaterialError, match="none of the subscriber keys"):
        KVEventsConfig.from_key_dir(tmp_path / "k", allow_names=("nobody",))
    with pytest.raises(KeyMaterialError):
        KVEventsConfig.from_key_dir(tmp_path / "k", key_name="missing")


def test_config_from_env() -> None:
    worker, router = generate_keypair("worker"), generate_keypair("router")
    assert KVEventsConfig.from_env({}) is None
    cfg = KVEventsConfig.from_env({ENV_WORKER_KEY: keypair_to_string(worker), ENV_ALLOWED_KEYS: router.public.decode()})
    assert cfg is not None and list(cfg.allowed.values()) == [router.public]
    with pytest.raises(KeyMaterialError, match="allow-list"):  # keys but nobody allowed: refuse to start
        KVEventsConfig.from_env({ENV_WORKER_KEY: keypair_to_string(worker)})
    with pytest.raises(KeyMaterialError, match="secret"):
        KVEventsConfig(generate_keypair("x").__class__("w", worker.public), {"r": router.public})
