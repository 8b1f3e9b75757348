"""The store connector between real engine processes on 127.0.0.1 (the test plays the router):
aggregated instances reuse each other's prefixes, and a disaggregated decode leg loads its
prefill leg's blocks; token-exact against an engine without a connector, no leaked blocks."""

from __future__ import annotations

import random
from typing import Any

import pytest

from pdcluster import LLM, SamplingParams

MAX_TOKENS = 6


def _args(model: str, role: str, options: dict[str, Any]) -> dict[str, Any]:
    return {"model": model, "num_kv_blocks": 96, "max_model_len": 256, "block_size": 16, "max_num_seqs": 16,
            "seed": 0, "kv_connector": "store", "kv_role": role, "kv_connector_options": options}


def _greedy(max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    return {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}


@pytest.fixture(scope="module")
def reference(demo_model: str) -> Any:
    llm = LLM(demo_model, num_kv_blocks=128, max_model_len=256, enable_prefix_caching=False)

    def generate(prompts: list[list[int]]) -> list[list[int]]:
        outs = llm.generate(prompts, [SamplingParams(**_greedy())] * len(prompts))
        return [o.outputs[0].token_ids for o in outs]

    return generate


@pytest.fixture(scope="module")
def procs(engine_procs: Any, demo_model: str, kvstore_master: str) -> dict[str, Any]:
    opts = {"master": kvstore_master, "namespace": "procs"}
    # Role "both" on each: with a store any instance serves either leg (and 2 CPUs start 2 engines faster).
    return engine_procs({"a": _args(demo_model, "both", opts), "b": _args(demo_model, "both", opts)})


def _idle(p: Any) -> None:
    p.wait_stats(lambda s: s["kv_blocks_used"] == 0 and s["num_held_for_transfer"] == 0, 30, "idle")


def test_instances_share_prefixes(procs: dict[str, Any], reference: Any) -> None:
    rng = random.Random(1)
    system = [rng.randrange(3, 500) for _ in range(64)]  # a long shared system prompt: 4 blocks
    prompts = [system + [rng.randrange(3, 500) for _ in range(n)] for n in (5, 21, 40)]
    a, b = procs["a"], procs["b"]
    a.add([{"request_id": "a0", "prompt": prompts[0], "params": _greedy()}])
    got = {"a0": a.wait(["a0"])["a0"]}
    _idle(a)  # its saves are in the store
    b.add([{"request_id": f"b{i}", "prompt": p, "params": _greedy()} for i, p in enumerate(prompts[1:], 1)])
    got.update(b.wait(["b1", "b2"]))
    want = reference(prompts)
    assert [got[k]["token_ids"] for k in ("a0", "b1", "b2")] == want
    assert all(got[k]["error"] is None for k in got)
    stats = b.stats()["kv_connector"]
    assert stats["store_hit_tokens"] >= 64  # the system prompt came from a's saves, not recomputed
    _idle(b)


def test_disaggregated_legs_through_the_store(procs: dict[str, Any], reference: Any) -> None:
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (7, 33, 80)]
    p, d = procs["a"], procs["b"]
    ids = [f"pd{i}" for i in range(len(prompts))]
    p.add([{"request_id": r, "prompt": x, "params": _greedy(1), "kv": {"do_remote_decode": True}}
           for r, x in zip(ids, prompts)])
    pre = p.wait(ids)
    before = d.stats()["kv_connector"]["store_hit_tokens"]
    # The decode legs go out at once: they wait (bounded) for the prefill's saves to land.
    d.add([{"request_id": r, "prompt": x, "params": _greedy(), "prior": pre[r]["token_ids"],
            "kv": {**pre[r]["kv"], "do_remote_prefill": True, "do_remote_decode": False}}
           for r, x in zip(ids, prompts)])
    dec = d.wait(ids)
    want = reference(prompts)
    for r, w in zip(ids, want):
        assert pre[r]["kv"]["connector"] == "store"
        assert dec[r]["error"] is None, dec[r]
        assert pre[r]["token_ids"] + dec[r]["token_ids"] == w
    assert d.stats()["kv_connector"]["store_hit_tokens"] - before == 0 + 32 + 80
    _idle(p)
    _idle(d)
