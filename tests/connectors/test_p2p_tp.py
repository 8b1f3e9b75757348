"""P2P hand-off between engine instances of different tensor-parallel sizes (real processes on
127.0.0.1; the test plays the router): P(TP=2) -> D(TP=2), P(TP=2) -> D(TP=1), P(TP=1) -> D(TP=2)
(shared memory; and TCP into a TP=2 decode) are token-exact against an aggregated TP=1 engine, every rank frees its blocks, and a decode
instance that loses a rank mid-transfer fails the request while the producer reclaims its blocks
by lease expiry."""

from __future__ import annotations

import os
import random
import signal
import time
from typing import Any

import pytest
from p2p_procs import engine_args
from test_p2p_processes import assert_no_blocks, decode, prefill

from pdcluster import LLM, SamplingParams

PROMPT_LENGTHS = [5, 17, 40]
GREEDY = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}


def _tp(args: dict[str, Any], tp: int) -> dict[str, Any]:
    return {**args, "tensor_parallel_size": tp, "dtype": "float32"}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def expected(demo_model: str, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(demo_model, num_kv_blocks=128, max_model_len=256, enable_prefix_caching=False, dtype="float32")
    outs = llm.generate(prompts, [SamplingParams(**GREEDY) for _ in prompts])
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def procs(engine_procs: Any, cluster_keys: Any, demo_model: str) -> dict[str, Any]:
    k = cluster_keys
    return engine_procs({
        "p1": _tp(engine_args(demo_model, "producer", k.options("producer", engine_id="p-tp1")), 1),
        "p2": _tp(engine_args(demo_model, "producer", k.options("producer2", engine_id="p-tp2",
                                                                lease_ttl_s=3.0)), 2),
        "d1": _tp(engine_args(demo_model, "consumer", k.options("consumer", engine_id="d-tp1")), 1),
        "d2": _tp(engine_args(demo_model, "consumer", k.options("consumer", engine_id="d-tp2")), 2),
        "d2tcp": _tp(engine_args(demo_model, "consumer", k.options("consumer", engine_id="d-tp2-tcp",
                                                                   transport="tcp")), 2),
    })


@pytest.mark.parametrize("pair", [("p2", "d2"), ("p2", "d1"), ("p1", "d2"), ("p2", "d2tcp"),
                                  ("p1", "d2tcp")])
def test_hand_off_between_tp_sizes_equals_aggregated(procs: dict[str, Any], prompts: list[list[int]],
                                                     expected: list[list[int]], pair: tuple[str, str]) -> None:
    pname, dname = pair
    params = [dict(GREEDY) for _ in prompts]
    tag = f"{pname}-{dname}"
    pre = prefill(procs[pname], tag, prompts, params)
    for out in pre.values():
        assert out["kv"]["producer_tp_size"] == (2 if pname == "p2" else 1)
    outs = decode(procs[dname], pre, prompts, params, tag)
    assert outs is not None
    got = [outs[f"{tag}-{i}"] for i in range(len(prompts))]
    for g in got:
        assert g["error"] is None, g
    # The decode leg continues after the prefill leg's first token.
    assert [pre[f"{tag}-{i}"]["token_ids"] + g["token_ids"] for i, g in enumerate(got)] == expected
    assert_no_blocks(procs[pname], pname)
    assert_no_blocks(procs[dname], dname)


def test_killed_decode_rank_fails_request_and_producer_reclaims(engine_procs: Any, cluster_keys: Any,
                                                                demo_model: str, procs: dict[str, Any],
                                                                prompts: list[list[int]]) -> None:
    k = cluster_keys
    slow = engine_procs({"d2slow": _tp(engine_args(demo_model, "consumer", k.options(
        # Parked long enough to be killed while waiting (1 s below), short enough that the
        # surviving rank's heartbeats stop soon after: the reclaim below waits for the pause,
        # then the 3 s lease.
        "consumer", engine_id="d-tp2-slow", debug_pause_before_read_s=10.0)), 2)})["d2slow"]
    assert len(slow.tp_pids) == 1
    params = [dict(GREEDY)]
    pre = prefill(procs["p2"], "kill", prompts[:1], params)
    decode(slow, pre, prompts[:1], params, "kill", wait=False)
    time.sleep(1.0)  # the load is parked before its read
    os.kill(slow.tp_pids[0], signal.SIGKILL)
    t0 = time.monotonic()
    out = slow.wait(["kill-0"], timeout_s=30.0)["kill-0"]
    assert out["error"] and "rank" in out["error"], out
    assert time.monotonic() - t0 < 30.0
    # Nobody will say done for rank 1's half: the producer reclaims by lease expiry (ttl 3 s).
    assert_no_blocks(procs["p2"], "p2", timeout_s=30.0)
