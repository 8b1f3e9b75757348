"""P2P hand-off between real engine processes on 127.0.0.1 (the test plays the router):
TCP and shared memory, token-exact against an aggregated engine, no leaked blocks, and the
failure cases: a consumer killed mid-transfer, a producer killed mid-transfer."""

from __future__ import annotations

import random
from typing import Any

import pytest
from p2p_procs import engine_args

from pdcluster import LLM, SamplingParams

PROMPT_LENGTHS = [1, 5, 16, 17, 33, 64, 100]
MAX_TOKENS = 8


def _greedy(**kw: Any) -> dict[str, Any]:
    return {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True, **kw}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def reference(demo_model: str) -> Any:
    """Aggregated outputs: a plain engine in this process."""
    llm = LLM(demo_model, num_kv_blocks=128, max_model_len=256, enable_prefix_caching=False)

    def generate(prompts: list[list[int]], params: list[dict[str, Any]]) -> list[list[int]]:
        outs = llm.generate(prompts, [SamplingParams(**p) for p in params])
        return [o.outputs[0].token_ids for o in outs]

    return generate


@pytest.fixture(scope="module")
def procs(engine_procs: Any, cluster_keys: Any, demo_model: str) -> dict[str, Any]:
    k = cluster_keys
    return engine_procs({
        "producer": engine_args(demo_model, "producer", k.options("producer", engine_id="producer", lease_ttl_s=3.0)),
        "tcp": engine_args(demo_model, "consumer", k.options("consumer", engine_id="c-tcp", transport="tcp")),
        "shm": engine_args(demo_model, "consumer", k.options("consumer", engine_id="c-shm", transport="shm")),
    })


def prefill(producer: Any, tag: str, prompts: list[list[int]], params: list[dict[str, Any]]) -> dict[str, Any]:
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    producer.add([{"request_id": rid, "prompt": p, "params": {**sp, "max_tokens": 1},
                   "kv": {"do_remote_decode": True}} for rid, p, sp in zip(ids, prompts, params)])
    outs = producer.wait(ids)
    for rid in ids:
        assert outs[rid]["error"] is None and outs[rid]["kv"], outs[rid]
    return outs


def decode(consumer: Any, pre: dict[str, Any], prompts: list[list[int]], params: list[dict[str, Any]],
           tag: str, wait: bool = True) -> dict[str, Any] | None:
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    consumer.add([{"request_id": rid, "prompt": p, "params": sp, "prior": pre[rid]["token_ids"],
                   "kv": {**pre[rid]["kv"], "do_remote_prefill": True, "do_remote_decode": False}}
                  for rid, p, sp in zip(ids, prompts, params)])
    return consumer.wait(ids) if wait else None


def assert_no_blocks(proc: Any, name: str, timeout_s: float = 30.0) -> dict[str, Any]:
    return proc.wait_stats(lambda s: s["kv_blocks_used"] == 0 and s["num_held_for_transfer"] == 0
                           and s["num_waiting_for_remote_kv"] == 0 and s["num_running"] == 0,
                           timeout_s, f"{name} to free every block")


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_batch_of_mixed_prompts_equals_aggregated(procs: dict[str, Any], prompts: list[list[int]],
                                                  reference: Any, transport: str) -> None:
    # Greedy for most, seeded sampling for two: per-position seeding makes both token-exact.
    params = [_greedy() for _ in prompts]
    params[2] = {"temperature": 0.8, "top_p": 0.9, "seed": 7, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    params[5] = {"temperature": 1.0, "seed": 11, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    expected = reference(prompts, params)
    producer, consumer = procs["producer"], procs[transport]
    pre = prefill(producer, transport, prompts, params)
    assert producer.stats()["num_held_for_transfer"] == len(prompts)  # delayed free under leases
    out = decode(consumer, pre, prompts, params, transport)
    assert out is not None
    for i in range(len(prompts)):
        rid = f"{transport}-{i}"
        assert out[rid]["error"] is None, out[rid]
        assert pre[rid]["token_ids"] + out[rid]["token_ids"] == expected[i], f"prompt {i} ({PROMPT_LENGTHS[i]} tokens)"
    moved = assert_no_blocks(consumer, f"consumer ({transport})")["kv_connector"]
    other = "shm" if transport == "tcp" else "tcp"
    assert moved[f"p2p_bytes_{transport}"] > 0 and moved[f"p2p_bytes_{other}"] == 0, moved
    assert moved["p2p_loads_failed"] == 0
    stats = assert_no_blocks(producer, "producer")["kv_connector"]
    assert stats["p2p_leases_expired"] == 0


def test_consumer_killed_mid_transfer_producer_frees_on_lease_expiry(
        procs: dict[str, Any], engine_procs: Any, cluster_keys: Any, demo_model: str,
        prompts: list[list[int]]) -> None:
    producer = procs["producer"]
    victim = engine_procs({"victim": engine_args(demo_model, "consumer", cluster_keys.options(
        "consumer", engine_id="victim", transport="tcp", debug_pause_before_read_s=60.0))})["victim"]
    before = producer.stats()["kv_connector"]
    pre = prefill(producer, "victim", prompts[4:5], [_greedy()])
    decode(victim, pre, prompts[4:5], [_greedy()], "victim", wait=False)
    producer.wait_stats(lambda s: s["kv_connector"].get("p2p_requests_p2p_open", 0)
                        > before.get("p2p_requests_p2p_open", 0), 60, "the consumer to open the transfer")
    assert producer.stats()["num_held_for_transfer"] == 1
    victim.kill()  # mid-transfer: lease open, nothing read, no "done" will ever come
    stats = assert_no_blocks(producer, "producer after its consumer died", timeout_s=30)["kv_connector"]
    assert stats["p2p_leases_expired"] == before["p2p_leases_expired"] + 1


def test_producer_killed_mid_transfer_fail_and_recompute(engine_procs: Any, cluster_keys: Any, demo_model: str,
                                                        prompts: list[list[int]], reference: Any) -> None:
    k = cluster_keys
    pause = {"transport": "tcp", "debug_pause_before_read_s": 3.0, "request_timeout_s": 2.0}
    p = engine_procs({
        "doomed": engine_args(demo_model, "producer", k.options("producer2", engine_id="doomed", transport="tcp")),
        "fail": engine_args(demo_model, "consumer", k.options("consumer", engine_id="c-fail", **pause)),
        "recompute": engine_args(demo_model, "consumer", k.options("consumer", engine_id="c-rec",
                                                                  failure_policy="recompute", **pause)),
    })
    chosen = [prompts[3], prompts[6]]
    expected = reference(chosen, [_greedy(), _greedy()])
    pre = prefill(p["doomed"], "doomed", chosen, [_greedy(), _greedy()])
    decode(p["fail"], {"doomed-0": pre["doomed-0"]}, chosen[:1], [_greedy()], "doomed", wait=False)
    pre1 = {"doomed-0": pre["doomed-1"]}
    decode(p["recompute"], pre1, chosen[1:], [_greedy()], "doomed", wait=False)
    p["doomed"].wait_stats(lambda s: s["kv_connector"].get("p2p_requests_p2p_open", 0) >= 2, 60,
                           "both consumers to open their transfers")
    p["doomed"].kill()
    failed = p["fail"].wait(["doomed-0"])["doomed-0"]
    assert failed["finish_reason"] == "error"
    assert "KV transfer failed" in failed["error"] and "'fail'" in failed["error"], failed["error"]
    done = p["recompute"].wait(["doomed-0"])["doomed-0"]
    assert done["error"] is None, done
    assert pre["doomed-1"]["token_ids"] + done["token_ids"] == expected[1]
    for name in ("fail", "recompute"):
        stats = assert_no_blocks(p[name], name)["kv_connector"]
        assert stats["p2p_loads_failed"] == 1
