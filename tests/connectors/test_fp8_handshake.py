"""FP8 KV caches and the connectors: the KV dtype is part of what producer and consumer must share.

- P2P: the handshake fingerprint carries kv_dtype; an fp8 producer and a float32 or bfloat16
  consumer are refused at the handshake with an error naming kv_cache_dtype (both directions).
- P2P end to end: an fp8 producer hands a prompt to an fp8 consumer; the consumer's blocks hold
  the producer's fp8 bytes and it decodes what a local fp8 engine decodes.
- Store: the key fingerprint (and so every key) differs between an fp8 and a bf16 instance, so
  neither ever reads the other's blocks; the layout moves 1-byte elements.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pdcluster.config import EngineArgs
from pdcluster.connectors import engine_connector_factory
from pdcluster.connectors.p2p.agent import ProducerAgent
from pdcluster.connectors.p2p.blocks import CacheGeometry
from pdcluster.connectors.p2p.options import P2POptions
from pdcluster.connectors.p2p.peer import ChannelPool, HandshakeCache, LoadError, Producer
from pdcluster.connectors.p2p.side_channel import SideChannelServer
from pdcluster.connectors.p2p.wire import fingerprint, fingerprint_mismatch
from pdcluster.connectors.store.options import build_layout
from pdcluster.connectors.testing import PREFILL_LEG, decode_leg, run_requests
from pdcluster.engine.llm_engine import LLMEngine
from pdcluster.sampling_params import SamplingParams
from pdcluster.security.keys import generate_keypair
from pdcluster.transfer import Region

PRODUCER, CONSUMER = generate_keypair("producer"), generate_keypair("consumer")
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _config(model: str, kv: str) -> Any:
    return EngineArgs(model=model, kv_cache_dtype=kv, num_kv_blocks=64, max_model_len=256,
                      device="cpu").create_engine_config()


def _opts(kp: Any, role: str, **kw: Any) -> P2POptions:
    allowed = {"producer": PRODUCER.public, "consumer": CONSUMER.public}
    return P2POptions(engine_id=f"fp8-{role}", kv_role=role, keypair=kp, allowed_keys=allowed, **kw)


@pytest.mark.parametrize("consumer_kv", ["float32", "bfloat16"])
@pytest.mark.parametrize("producer_is_fp8", [True, False], ids=["fp8-producer", "fp8-consumer"])
def test_p2p_handshake_refuses_another_kv_dtype(demo_model: str, consumer_kv: str, producer_is_fp8: bool) -> None:
    fp8, other = fingerprint(_config(demo_model, "fp8")), fingerprint(_config(demo_model, consumer_kv))
    assert fp8["kv_dtype"] == "float8_e4m3fn" and other["kv_dtype"] == consumer_kv
    theirs, ours = (fp8, other) if producer_is_fp8 else (other, fp8)
    assert "kv_cache_dtype" in (fingerprint_mismatch(ours, theirs) or "")
    geo = CacheGeometry(num_layers=2, num_blocks=4, block_nbytes=256)
    cache = torch.zeros(geo.nbytes, dtype=torch.uint8)
    popts = _opts(PRODUCER, "producer", lease_ttl_s=30.0)
    agent = ProducerAgent(popts, theirs, geo, Region.from_buffer(cache), None)
    side = SideChannelServer(agent, popts)
    pool = ChannelPool(_opts(CONSUMER, "consumer", request_timeout_s=2.0))
    try:
        producer = Producer("fp8-producer", side.endpoint, PRODUCER.public)
        with pytest.raises(LoadError, match="kv_cache_dtype"):
            HandshakeCache(pool, _opts(CONSUMER, "consumer"), ours).get(producer, 0)
        assert HandshakeCache(pool, _opts(CONSUMER, "consumer"), theirs).get(producer, 0).body  # same dtype: fine
    finally:
        pool.close()
        side.close()
        agent.close()


def test_store_key_fingerprint_includes_the_kv_dtype(demo_model: str) -> None:
    layouts = {kv: build_layout({}, _config(demo_model, kv)) for kv in ("fp8", "bfloat16", "float32")}
    assert layouts["fp8"].kv_dtype == "float8_e4m3fn" and layouts["fp8"].itemsize == 1
    assert len({lay.fingerprint for lay in layouts.values()}) == 3
    assert len({lay.key_prefix for lay in layouts.values()}) == 3
    h = bytes(range(32))
    assert layouts["fp8"].key(0, h) != layouts["bfloat16"].key(0, h)


def _engine(model: str, kv: str, role: str | None, options: dict[str, Any] | None = None) -> LLMEngine:
    args = EngineArgs(model=model, kv_cache_dtype=kv, num_kv_blocks=64, max_model_len=256, block_size=16,
                      enable_prefix_caching=role is not None, kv_connector="p2p" if role else None,
                      kv_role=role or "both", kv_connector_options=options, device="cpu")
    return LLMEngine.from_engine_args(args, connector=engine_connector_factory if role else None)


def _handoff(model: str, keys: Any, kv: str) -> tuple[LLMEngine, LLMEngine, LLMEngine, dict[str, list[int]]]:
    ref = _engine(model, kv, None)
    producer = _engine(model, kv, "producer", keys.options("producer", engine_id=f"{kv}-p", lease_ttl_s=5.0))
    consumer = _engine(model, kv, "consumer", keys.options("consumer", engine_id=f"{kv}-c", transport="tcp",
                                                           open_retry_s=0.3))
    p_blocks, c_blocks = _record_blocks(producer), _record_blocks(consumer)
    try:
        prompt = [(7 * i) % 400 + 3 for i in range(40)]
        want = run_requests(ref, [("r", prompt, GREEDY, None, None)], [])["r"].outputs[0].token_ids
        pre = run_requests(producer, [("r", prompt, GREEDY.replace(max_tokens=1), PREFILL_LEG, None)], [])["r"]
        out = run_requests(consumer, [("r", prompt, GREEDY, decode_leg(pre), pre.outputs[0].token_ids)],
                           [producer])["r"]
        assert consumer.get_stats()["external_prefix_hits"] > 0  # the prompt's KV came from the producer
        assert pre.outputs[0].token_ids + out.outputs[0].token_ids == want
    except BaseException:
        for e in (ref, producer, consumer):
            e.shutdown()
        raise
    return ref, producer, consumer, {"p": p_blocks["r"], "c": c_blocks["r"]}


def test_p2p_moves_fp8_bytes(demo_model: str, cluster_keys: Any) -> None:
    moved = {}
    for kv in ("fp8", "bfloat16"):
        engines = ref, producer, consumer, blocks = _handoff(demo_model, cluster_keys, kv)
        try:
            moved[kv] = consumer.get_stats()["kv_connector"]["p2p_bytes_tcp"]
            if kv == "fp8":
                p_cache, c_cache = producer.core.runner.kv_caches, consumer.core.runner.kv_caches
                assert p_cache.dtype == c_cache.dtype == torch.float8_e4m3fn
                # The two full prompt blocks, every layer, K and V: byte for byte the producer's fp8 bytes.
                pb = p_cache[:, :, blocks["p"][:2]].view(torch.uint8)
                cb = c_cache[:, :, blocks["c"][:2]].view(torch.uint8)
                assert pb.any() and torch.equal(pb, cb)
        finally:
            for e in engines[:3]:
                e.shutdown()
    print(f"p2p hand-off of a 40-token prompt, bytes over tcp: {moved}")
    assert moved["fp8"] > 0 and 2 * moved["fp8"] == moved["bfloat16"]  # half the bytes for the same blocks


def _record_blocks(engine: LLMEngine) -> dict[str, list[int]]:
    """request id -> the block ids the runner was given for it (kept after the request ends)."""
    runner = engine.core.runner
    seen: dict[str, list[int]] = {}
    update = runner.update_states

    def recording(scheduler_output: Any) -> None:
        for new in scheduler_output.scheduled_new_reqs:
            seen.setdefault(new.request_id, []).extend(new.block_ids)
        for cached in scheduler_output.scheduled_cached_reqs:
            seen.setdefault(cached.request_id, []).extend(cached.new_block_ids)
        update(scheduler_output)

    runner.update_states = recording
    return seen
