"""Two engines sharing one built-in store: a prefix one computed, the other loads (both layouts)."""

from __future__ import annotations

import random

import pytest
from store_engines import generate, greedy, make_engine, settle, wait_events

from pdcluster.engine.block_pool import BlockStored


@pytest.fixture(scope="module")
def reference(demo_model: str):
    engine = make_engine(demo_model, None)
    yield engine
    engine.shutdown()


def _backend_options(request: pytest.FixtureRequest, backend: str) -> dict:
    if backend == "kvstore":
        return {"master": request.getfixturevalue("kvstore_master")}
    return {"backend": "mooncake", "mooncake_master": request.getfixturevalue("mooncake_master")}


@pytest.mark.parametrize("layout,backend", [("LBHNC", "kvstore"), ("LBNHC", "kvstore"), ("LBHNC", "mooncake")])
def test_second_instance_loads_prefix(demo_model: str, request: pytest.FixtureRequest, reference, layout: str,
                                      backend: str) -> None:
    rng = random.Random(f"{layout}-{backend}")
    shared = [rng.randrange(3, 500) for _ in range(5 * 16 + 3)]  # 5 full blocks + 3 tokens
    prompt_a = shared + [rng.randrange(3, 500) for _ in range(9)]
    prompt_b = shared + [rng.randrange(3, 500) for _ in range(20)]
    opts = {**_backend_options(request, backend), "layout": layout, "namespace": f"reuse-{layout}"}
    a, b = make_engine(demo_model, opts), make_engine(demo_model, opts)
    try:
        out_a = generate(a, {"a": prompt_a})["a"]
        settle(a)  # saves written, blocks released
        stored = wait_events(a, 6)  # 5 shared blocks + the one full block of a's own suffix ... and output
        assert all(isinstance(e, BlockStored) for e in stored)
        out_b = generate(b, {"b": prompt_b})["b"]
        settle(b)
        ref = generate(reference, {"ref-a": prompt_a, "ref-b": prompt_b})
        assert out_a.outputs[0].token_ids == ref["ref-a"].outputs[0].token_ids
        assert out_b.outputs[0].token_ids == ref["ref-b"].outputs[0].token_ids
        assert out_a.num_cached_tokens == 0
        assert out_b.num_cached_tokens == 5 * 16  # the shared full blocks came from the store
        sa, sb = a.get_stats()["kv_connector"], b.get_stats()["kv_connector"]
        assert sb["store_hit_tokens"] == 80 and sb["store_load_requests"] == 1
        assert sa["store_hit_tokens"] == 0
        # b saved only its own new blocks, never the ones it loaded.
        assert sb["store_save_blocks"] == (len(prompt_b) + 8 - 1) // 16 - 5
        # A third request on b itself now hits b's local prefix cache, not the store.
        out_b2 = generate(b, {"b2": prompt_b})["b2"]
        assert out_b2.outputs[0].token_ids == out_b.outputs[0].token_ids
        assert b.get_stats()["kv_connector"]["store_load_requests"] == 1
        settle(b)
    finally:
        a.shutdown()
        b.shutdown()


def test_whole_prompt_in_store_still_computes_last_token(demo_model: str, kvstore_master: str, reference) -> None:
    prompt = [random.Random(7).randrange(3, 500) for _ in range(48)]  # exactly 3 blocks
    opts = {"master": kvstore_master, "namespace": "whole"}
    a, b = make_engine(demo_model, opts), make_engine(demo_model, opts)
    try:
        generate(a, {"a": prompt}, greedy(1))
        settle(a)
        wait_events(a, 3)
        out = generate(b, {"b": prompt})["b"]
        settle(b)
        assert out.num_cached_tokens == 47  # 3 blocks loaded, the last token recomputed
        assert out.outputs[0].token_ids == generate(reference, {"r": prompt})["r"].outputs[0].token_ids
    finally:
        a.shutdown()
        b.shutdown()


def test_cache_salt_keys_the_store(demo_model: str, kvstore_master: str, reference) -> None:
    """Store keys derive from the chained block hashes, so a salted prompt's objects are found by
    that salt only: another instance with another salt (or none) computes the prompt itself."""
    prompt = [random.Random(11).randrange(3, 500) for _ in range(48 + 5)]  # 3 full blocks
    opts = {"master": kvstore_master, "namespace": "salted"}
    a, b = make_engine(demo_model, opts), make_engine(demo_model, opts)
    try:
        generate(a, {"a": prompt}, greedy().replace(cache_salt="tenant-a"))
        settle(a)
        wait_events(a, 3)
        want = generate(reference, {"r": prompt})["r"].outputs[0].token_ids
        for rid, salt, hit in (("other", "tenant-b", 0), ("none", None, 0), ("same", "tenant-a", 48)):
            out = generate(b, {rid: prompt}, greedy().replace(cache_salt=salt))[rid]
            settle(b)
            assert out.outputs[0].token_ids == want, rid
            assert out.num_cached_tokens == hit, rid
            b.core.scheduler.reset_prefix_cache()  # the next one must come from the store or nowhere
    finally:
        a.shutdown()
        b.shutdown()
