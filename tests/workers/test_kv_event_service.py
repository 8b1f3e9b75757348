"""KVEventService in-process over a real engine: the engine's block events are published in order,
snapshots hold exactly the published state, and key configuration fails closed."""

from __future__ import annotations

import asyncio
import pathlib

import pytest
import zmq

from pdcluster._proto import worker_pb2
from pdcluster.config import EngineArgs
from pdcluster.engine.async_engine import AsyncEngine
from pdcluster.engine.block_hash import compute_block_hashes
from pdcluster.engine.block_pool import AllBlocksCleared, BlockRemoved, BlockStored
from pdcluster.sampling_params import SamplingParams
from pdcluster.security.curve import make_client_socket
from pdcluster.security.keys import KeyMaterialError, generate_keypair, init_keys, keypair_to_string
from pdcluster.worker.kv_events import ENV_ALLOWED_KEYS, ENV_WORKER_KEY, KVEventsConfig
from pdcluster.worker.kv_events_pub import decode_batch, decode_snapshot, encode_snapshot_request
from pdcluster.worker.server import start_worker_server


async def _recv(sock: zmq.Socket, timeout_s: float = 30.0) -> bytes:  # generous: a slow machine
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


def _apply(state: set[bytes], events) -> None:
    for ev in events:
        if isinstance(ev, BlockStored):
            state.update(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            state.difference_update(ev.block_hashes)
        elif isinstance(ev, AllBlocksCleared):
            state.clear()


def test_publish_order_and_snapshot(demo_model: str) -> None:
    worker_kp, router_kp = generate_keypair("worker"), generate_keypair("router")
    config = KVEventsConfig(worker_kp, {"router": router_kp.public}, interval_s=0.01, heartbeat_s=0.2)
    prompt = list(range(10, 50))  # 40 tokens: two full blocks of 16
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def main():
        engine = AsyncEngine.from_engine_args(EngineArgs(model=demo_model, max_model_len=256, block_size=16))
        server, _ = await start_worker_server(engine, "both", kv_events=config, worker_id="w1", epoch=42)
        ctx = zmq.Context()
        try:
            info = server.servicer.kv_events_info()
            assert info.public_key == worker_kp.public and info.epoch == 42
            sub = make_client_socket(ctx, zmq.SUB, router_kp, worker_kp.public, info.events_endpoint)
            sub.subscribe(b"")
            dealer = make_client_socket(ctx, zmq.DEALER, router_kp, worker_kp.public, info.snapshot_endpoint)
            await _recv(sub)  # a heartbeat: connected
            async for _ in engine.generate(prompt, sp, request_id="r1"):
                pass
            published: set[bytes] = set()
            batch = await _next_batch_with_events(sub)
            assert batch.publisher_id == "w1" and batch.epoch == 42 and batch.seq == 1
            _apply(published, batch.events)
            assert set(compute_block_hashes(prompt, 16)) <= published  # the prompt's full blocks
            dealer.send(encode_snapshot_request("w1", 5))
            snap = decode_snapshot(await _recv(dealer))
            assert snap.seq == batch.seq and set(snap.block_hashes) == published
            # Clearing the prefix cache is published as one more batch; the snapshot follows it.
            assert await engine.call(lambda e: e.core.scheduler.reset_prefix_cache())
            batch2 = await _next_batch_with_events(sub)
            assert batch2.seq == batch.seq + 1 and any(isinstance(e, AllBlocksCleared) for e in batch2.events)
            _apply(published, batch2.events)
            dealer.send(encode_snapshot_request("w1", 6))
            snap = decode_snapshot(await _recv(dealer))
            assert snap.seq == batch2.seq and set(snap.block_hashes) == published == set()
            stats = await server.servicer.Stats(worker_pb2.StatsRequest(), None)
            assert stats.kv_events_seq == batch2.seq and stats.kv_events_epoch == 42
            assert stats.kv_events_endpoint == info.events_endpoint
            sub.close()
            dealer.close()
        finally:
            await server.stop(None)
            engine.shutdown()
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
