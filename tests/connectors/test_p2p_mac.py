"""P2P payload integrity end to end: engines in one process, an on-path proxy between the
consumer and the producer's data plane that flips a byte of what the producer sends. The MAC
check fails the load: under "recompute" the request's output equals the aggregated (one-engine)
output, under "fail" the request fails clearly; nothing decodes from the tampered bytes. Then the
tokens of one open: a replay is refused and counted, and they die with their lease."""

from __future__ import annotations

import pathlib
import random
import sys
from typing import Any

import pytest

from pdcluster.config import EngineArgs
from pdcluster.connectors import engine_connector_factory
from pdcluster.connectors.testing import PREFILL_LEG, assert_idle, decode_leg, run_requests
from pdcluster.engine.llm_engine import LLMEngine
from pdcluster.sampling_params import SamplingParams
from pdcluster.transfer import TransferError
from pdcluster.transfer.protocol import RESP_HEADER

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "transfer"))
from tamper_proxy import TamperProxy  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _engine(model: str, role: str | None, options: dict[str, Any] | None = None) -> LLMEngine:
    args = EngineArgs(model=model, num_kv_blocks=96, max_model_len=256, block_size=16,
                      enable_prefix_caching=role is not None, kv_connector="p2p" if role else None,
                      kv_role=role or "both", kv_connector_options=options)
    return LLMEngine.from_engine_args(args, connector=engine_connector_factory if role else None)


def _worker(engine: LLMEngine) -> Any:
    return engine.core.runner.connector_hooks.connector._worker


@pytest.fixture(scope="module")
def setup(demo_model: str, cluster_keys: Any) -> Any:
    k = cluster_keys
    made = {"ref": _engine(demo_model, None),
            "producer": _engine(demo_model, "producer", k.options("producer", engine_id="mac-producer",
                                                                  lease_ttl_s=20.0)),
            "recompute": _engine(demo_model, "consumer", k.options("consumer", engine_id="mac-recompute",
                                                                   transport="tcp", failure_policy="recompute")),
            "fail": _engine(demo_model, "consumer", k.options("consumer", engine_id="mac-fail", transport="tcp"))}
    agent = _worker(made["producer"]).agent
    proxy = TamperProxy(agent.server.address, flip_at=RESP_HEADER.size + 777)
    real_body = agent.body
    agent.body = lambda: {**real_body(), "data_port": proxy.address[1]}  # consumers reach it via the proxy
    yield made, proxy
    proxy.close()
    for e in made.values():
        e.shutdown()


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def _handoff(made: dict[str, LLMEngine], consumer: str, rid: str, prompt: list[int]) -> tuple[list[int], Any]:
    producer = made["producer"]
    pre = run_requests(producer, [(rid, prompt, GREEDY.replace(max_tokens=1), PREFILL_LEG, None)], [])[rid]
    out = run_requests(made[consumer], [(rid, prompt, GREEDY, decode_leg(pre), pre.outputs[0].token_ids)],
                       [producer])[rid]
    return pre.outputs[0].token_ids + out.outputs[0].token_ids, out


def _reference(made: dict[str, LLMEngine], rid: str, prompt: list[int]) -> list[int]:
    return run_requests(made["ref"], [(rid, prompt, GREEDY, None, None)], [])[rid].outputs[0].token_ids


def test_untampered_transfer_passes_its_macs(setup: Any) -> None:
    made, proxy = setup
    prompt = _prompt(50, 11)
    got, _ = _handoff(made, "fail", "clean", prompt)
    assert got == _reference(made, "ref-clean", prompt)
    loader = _worker(made["fail"]).loader
    assert loader.counters["loads_ok"] >= 1 and loader.counters["bytes_tcp"] > 0 and proxy.flipped == 0


def test_tampered_payload_recomputes_to_the_aggregated_output(setup: Any) -> None:
    made, proxy = setup
    prompt = _prompt(50, 12)
    loader = _worker(made["recompute"]).loader
    failed_before = loader.counters["loads_failed"]
    proxy.armed.set()
    try:
        got, out = _handoff(made, "recompute", "tampered-r", prompt)
    finally:
        proxy.armed.clear()
    assert proxy.flipped >= 1
    assert loader.counters["loads_failed"] == failed_before + 1
    assert "integrity" in loader.last_errors["tampered-r"]
    assert out.error is None and got == _reference(made, "ref-tampered-r", prompt)
    for name in ("producer", "recompute"):
        assert_idle(made[name], [], name, timeout_s=30)


def test_tampered_payload_fails_clearly_under_fail(setup: Any) -> None:
    made, proxy = setup
    prompt = _prompt(50, 13)
    proxy.armed.set()
    try:
        _, out = _handoff(made, "fail", "tampered-f", prompt)
    finally:
        proxy.armed.clear()
    assert out.outputs[0].finish_reason == "error" and "KV transfer failed" in (out.error or "")
    assert "integrity" in _worker(made["fail"]).loader.last_errors["tampered-f"]
    for name in ("producer", "fail"):
        assert_idle(made[name], [], name, timeout_s=30)


def test_tokens_are_single_use_and_die_with_the_lease(setup: Any) -> None:
    from pdcluster.connectors.p2p.blocks import CacheGeometry, block_ranges, chunk_block_ids
    from pdcluster.connectors.p2p.peer import call, resolve_producer
    from pdcluster.connectors.p2p.wire import DONE, OPEN

    made, _ = setup
    producer = made["producer"]
    prompt = _prompt(40, 14)
    pre = run_requests(producer, [("replay", prompt, GREEDY.replace(max_tokens=1), PREFILL_LEG, None)], [])["replay"]
    producer.step()  # registers the lease
    kv = decode_leg(pre)
    loader = _worker(made["fail"]).loader
    agent = _worker(producer).agent
    hs = loader.handshakes.get(resolve_producer(kv, loader.opts), agent.epoch)
    reply = call(loader.pool, hs.producer, OPEN, {"request_id": "replay", "transfer_id": kv.transfer_id,
                                                  "lease_id": kv.lease_id, "first_block": 0})
    assert reply["ok"], reply
    geo = CacheGeometry(agent.geo.num_layers, hs.body["num_blocks"], hs.body["block_nbytes"])
    chunk = chunk_block_ids(reply["block_ids"], geo.num_layers)[0]
    ranges = block_ranges(geo, chunk)
    nbytes = sum(n for _, n in ranges)
    addr = agent.server.address  # straight to the producer, no proxy
    token, mac_key = reply["tokens"][0], reply["mac_keys"][0]
    loader.reader.read(addr, token, ranges, memoryview(bytearray(nbytes)), [(0, nbytes)], mac_key)
    before = agent.stats().get("p2p_data_refused_replayed", 0)
    with pytest.raises(TransferError) as info:
        loader.reader.read(addr, token, ranges, memoryview(bytearray(nbytes)), [(0, nbytes)], mac_key)
    assert info.value.status == "replayed"
    assert agent.stats()["p2p_data_refused_replayed"] == before + 1
    # A second open of the live lease mints fresh tokens; once the lease is released they are dead.
    again = call(loader.pool, hs.producer, OPEN, {"request_id": "replay", "transfer_id": kv.transfer_id,
                                                  "lease_id": kv.lease_id, "first_block": 0})
    assert again["ok"] and again["tokens"][0] != token
    done = call(loader.pool, hs.producer, DONE, {"request_id": "replay", "transfer_id": kv.transfer_id,
                                                 "lease_id": kv.lease_id, "ok": True})
    assert done["status"] == "released"
    with pytest.raises(TransferError) as info:
        loader.reader.read(addr, again["tokens"][0], ranges, memoryview(bytearray(nbytes)), [(0, nbytes)],
                           again["mac_keys"][0])
    assert info.value.status == "revoked"
    assert agent.stats()["p2p_data_refused_revoked"] >= 1
    assert_idle(producer, [], "producer", timeout_s=30)
