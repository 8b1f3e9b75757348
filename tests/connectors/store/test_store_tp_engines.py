"""The store connector in engines with tensor_parallel_size > 1 (real engines: rank 0 in this
process, rank 1 a child process over gloo; a real kvstore master and node on 127.0.0.1; a tiny
random llama made by transformers, 2 KV heads, so a TP=2 rank holds one head and one shard).

    disaggregated through the store, P(TP=2) -> D(TP=1) and P(TP=1) -> D(TP=2), both layouts:
    greedy tokens equal an aggregated TP=1 engine's, and the decode leg loaded the prompt's
    blocks from the store (num_cached_tokens, store hit and load counters), not recomputed them;
    one unreadable shard fails its block for every rank: the rank that read its own shard fine
    must not make the block count as loaded (reports are gathered to rank 0 and unioned);
    one KV head on two ranks (replicated): rank 0 alone writes it, both ranks read it.

Neither instance sets tp_sizes or store_tp_size: by default every TP size in 1, 2, 4, 8 cuts
blocks into the same gcd(8, KV heads) shards and names them alike (a default of the instance's own
TP would give the TP=1 instance 1 shard, the TP=2 one 2, and no shared block). An instance that
does cut differently (tp_sizes=[1]) never loads a TP=2 producer's blocks: it says so and computes.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from distributed.tp_procs import alive, wait_dead
from store_engines import generate, greedy, make_engine, settle

from pdcluster.config import EngineArgs
from pdcluster.connectors.store.backend import PutResult
from pdcluster.connectors.store.backend_factory import make_backend
from pdcluster.connectors.store.meta import StoreHandoff
from pdcluster.connectors.store.options import StoreOptions
from pdcluster.connectors.testing import PREFILL_LEG
from pdcluster.engine.block_hash import compute_block_hashes
from pdcluster.engine.llm_engine import LLMEngine

MAX_TOKENS = 6
PROMPT_LENGTHS = (37, 70)  # 2 and 4 full blocks of 16, plus a partial one
VOCAB = 384  # tests/tiny_models.py TINY_COMMON


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tiny_models import make_tiny_checkpoint

    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny-llama"), dtype=torch.float32)


def _engine(model: str, options: dict[str, Any] | None, tp: int = 1) -> LLMEngine:
    return make_engine(model, options, tp=tp, num_blocks=48, max_model_len=256)


@pytest.fixture(scope="module")
def reference(tiny_model: str) -> Iterator[LLMEngine]:
    engine = _engine(tiny_model, None)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module", params=["LBHNC", "LBNHC"])
def engines(request: pytest.FixtureRequest, tiny_model: str, kvstore_master: str) -> Iterator[dict[Any, Any]]:
    """{1: a TP=1 engine, 2: a TP=2 engine, "layout": ...} sharing one store; one pair per layout."""
    layout = request.param
    # A long bound on the decode leg's wait for the producer's saves: it ends as soon as they land,
    # and a loaded test machine must not turn a late save into a recompute.
    opts = {"master": kvstore_master, "layout": layout, "namespace": f"tp-engines-{layout}",
            "wait_for_producer_s": 60.0}
    made: dict[Any, Any] = {"layout": layout}
    pids: list[int] = []
    try:
        made[2] = _engine(tiny_model, opts, tp=2)
        pids.extend(made[2].core.runner.pids.values())
        made[1] = _engine(tiny_model, opts, tp=1)
        yield made
    finally:
        for tp in (1, 2):
            if tp in made:
                made[tp].shutdown()
        for pid in wait_dead(pids, 10.0):  # a rank that outlived shutdown: by pid, never by name
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def _prompts(tag: str) -> dict[str, list[int]]:
    rng = random.Random(tag)
    return {f"{tag}-{i}": [rng.randrange(3, VOCAB) for _ in range(n)] for i, n in enumerate(PROMPT_LENGTHS)}


def _expected(reference: LLMEngine, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    outs = generate(reference, {f"ref-{rid}": p for rid, p in prompts.items()}, greedy(MAX_TOKENS))
    settle(reference)
    return {rid: outs[f"ref-{rid}"].outputs[0].token_ids for rid in prompts}


def _worker_stats(engine: LLMEngine) -> dict[str, Any]:
    """Rank 0's worker-side store counters (at TP > 1 the engine's stats carry only the scheduler's)."""
    runner = engine.core.runner
    runner = getattr(runner, "runner", runner)  # TPExecutor -> rank 0's ModelRunner
    return runner.connector_hooks.connector.get_stats()


def _layout(engine: LLMEngine) -> Any:
    return engine.core.connector.layout


@pytest.mark.parametrize("options,tps", [({}, (1, 2, 4)), ({"tp_sizes": [1, 2]}, (1, 2)),
                                         ({"store_tp_size": 2}, (1, 2, 4)), ({"tp_sizes": [4, 1, 2]}, (1, 2, 4))])
def test_default_options_give_every_tp_size_the_same_keys(tiny_model: str, options: dict, tps: tuple) -> None:
    layouts = {}
    for tp in tps:  # 4 > the model's 2 KV heads: replicated, one head per shard
        config = EngineArgs(model=tiny_model, tensor_parallel_size=tp, dtype="float32").create_engine_config()
        layouts[tp] = StoreOptions.from_dict(dict(options), config).layout
    assert {lay.store_tp_size for lay in layouts.values()} == {2}
    assert len({lay.key_prefix for lay in layouts.values()}) == 1
    one_object = EngineArgs(model=tiny_model, dtype="float32").create_engine_config()
    assert StoreOptions.from_dict({"tp_sizes": [1]}, one_object).layout.store_tp_size == 1
    with pytest.raises(ValueError, match="must include"):
        StoreOptions.from_dict({"tp_sizes": [2]}, one_object)


def test_instances_of_both_tp_sizes_agree_on_keys(engines: dict[Any, Any]) -> None:
    one, two = _layout(engines[1]), _layout(engines[2])
    assert one.store_tp_size == two.store_tp_size == 2
    assert one.key_prefix == two.key_prefix
    assert engines[2].core.runner.handshake_metadata_all() == {
        r: {"connector": "store", "key_prefix": one.key_prefix} for r in range(2)}


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2)], ids=["P2-D1", "P1-D2"])
def test_disaggregated_between_tp_sizes_equals_aggregated(engines: dict[Any, Any], reference: LLMEngine,
                                                          p_tp: int, d_tp: int) -> None:
    prompts = _prompts(f"{engines['layout']}-P{p_tp}-D{d_tp}")
    want = _expected(reference, prompts)
    p, d = engines[p_tp], engines[d_tp]
    pre = generate(p, prompts, greedy(1), kv={rid: PREFILL_LEG for rid in prompts})
    for rid, prompt in prompts.items():
        params = pre[rid].kv_transfer_params
        assert params is not None and params.connector == "store", params
        assert params.num_tokens == len(prompt) // 16 * 16
        assert StoreHandoff.of(params).key_prefix == _layout(d).key_prefix
    before, worker_before = dict(d.get_stats()["kv_connector"]), _worker_stats(d)
    # The decode legs go out at once, as a router sends them: they wait (bounded) for the saves.
    dec = generate(d, prompts, greedy(MAX_TOKENS), prior={rid: pre[rid].outputs[0].token_ids for rid in prompts},
                   kv={rid: pre[rid].kv_transfer_params.for_decode_leg() for rid in prompts})
    for rid, prompt in prompts.items():
        assert dec[rid].error is None, dec[rid].error
        assert pre[rid].outputs[0].token_ids + dec[rid].outputs[0].token_ids == want[rid], rid
        assert pre[rid].num_cached_tokens == 0
        # The prompt's full blocks came from the store; only the rest was computed here.
        assert dec[rid].num_cached_tokens == len(prompt) // 16 * 16, \
            (rid, d.get_stats()["kv_connector"], _worker_stats(d), p.get_stats()["kv_connector"], _worker_stats(p))
    after, worker_after = d.get_stats()["kv_connector"], _worker_stats(d)
    full_blocks = sum(len(x) // 16 for x in prompts.values())
    assert after["store_hit_tokens"] - before["store_hit_tokens"] == 16 * full_blocks
    assert after["store_load_requests"] - before["store_load_requests"] == len(prompts)
    assert worker_after["store_load_blocks"] - worker_before["store_load_blocks"] == full_blocks
    assert worker_after["store_load_failed_blocks"] == worker_before["store_load_failed_blocks"]
    # Each rank read its own shards: rank 0 of a TP=2 instance one object per block, TP=1 both.
    assert worker_after["store_load_bytes"] - worker_before["store_load_bytes"] == \
        full_blocks * (2 // d_tp) * _layout(d).object_nbytes
    settle(p)
    settle(d)


@pytest.mark.parametrize("bad_shard", [1, 0], ids=["rank1-shard", "rank0-shard"])
def test_one_unreadable_shard_fails_the_block_on_every_rank(engines: dict[Any, Any], reference: LLMEngine,
                                                             kvstore_master: str, bad_shard: int) -> None:
    src, tp2 = engines[1], engines[2]
    tag = f"{engines['layout']}-bad{bad_shard}"
    prompt = random.Random(tag).choices(range(3, VOCAB), k=70)  # 4 full blocks
    want = _expected(reference, {tag: prompt})[tag]
    generate(src, {f"{tag}-src": prompt}, greedy(MAX_TOKENS))
    settle(src)
    # Block 2's `bad_shard` object is replaced by one of the wrong size: batch_exists still finds
    # every shard (the lookup matches 4 blocks) but the rank that reads that shard cannot load it.
    hashes = compute_block_hashes(prompt, 16)
    lay = _layout(tp2)
    key = lay.key(bad_shard, hashes[2])
    backend = make_backend("kvstore", {"master": kvstore_master})
    try:
        deadline = time.monotonic() + 30.0
        while not all(backend.batch_exists(lay.keys_for(hashes))):  # src's saves of the 4 blocks landed
            assert time.monotonic() < deadline, "the source instance's saves did not land"
            time.sleep(0.02)
        assert backend.remove([key]) == [True]
        assert backend.batch_put_from([key], [torch.zeros(8, dtype=torch.uint8)]) == [PutResult.STORED]
        assert all(backend.batch_exists(lay.keys_for(hashes)))
    finally:
        backend.close()
    stats_before, worker_before = dict(tp2.get_stats()["kv_connector"]), _worker_stats(tp2)
    out = generate(tp2, {tag: prompt}, greedy(MAX_TOKENS))[tag]
    assert out.error is None, out.error
    assert out.outputs[0].token_ids == want
    # Blocks 0-1 loaded on both ranks; block 2 failed on one rank, so it and the rest of the
    # prefix were recomputed on both (recompute policy), whichever rank's report said so.
    assert out.num_cached_tokens == 32
    assert tp2.get_stats()["kv_connector"]["store_hit_tokens"] - stats_before["store_hit_tokens"] == 64
    worker = _worker_stats(tp2)
    rank0_failed = worker["store_load_failed_blocks"] - worker_before["store_load_failed_blocks"]
    assert rank0_failed == (2 if bad_shard == 0 else 0)  # rank 0 reads shard 0 only
    settle(tp2)


def test_decode_leg_with_other_shards_says_so_and_computes(engines: dict[Any, Any], reference: LLMEngine,
                                                          tiny_model: str, kvstore_master: str) -> None:
    """tp_sizes=[1] cuts blocks into 1 shard, the TP=2 producer into 2: the keys differ, nothing
    can be loaded, and the decode leg must neither wait for the promise nor pass silently."""
    layout = engines["layout"]
    prompts = _prompts(f"{layout}-foreign")
    want = _expected(reference, prompts)
    other = _engine(tiny_model, {"master": kvstore_master, "layout": layout, "namespace": f"tp-engines-{layout}",
                                 "tp_sizes": [1], "wait_for_producer_s": 60.0})
    try:
        assert _layout(other).store_tp_size == 1
        pre = generate(engines[2], prompts, greedy(1), kv={rid: PREFILL_LEG for rid in prompts})
        dec = generate(other, prompts, greedy(MAX_TOKENS), prior={rid: pre[rid].outputs[0].token_ids for rid in prompts},
                       kv={rid: pre[rid].kv_transfer_params.for_decode_leg() for rid in prompts})
        for rid in prompts:
            assert pre[rid].outputs[0].token_ids + dec[rid].outputs[0].token_ids == want[rid]
            assert dec[rid].num_cached_tokens == 0
        stats = other.get_stats()["kv_connector"]
        assert stats["store_foreign_key_prefix"] == len(prompts)
        assert stats["store_hit_tokens"] == 0
        settle(engines[2])
        settle(other)
    finally:
        other.shutdown()


def test_replicated_kv_head_between_tp_sizes(tmp_path_factory: pytest.TempPathFactory, kvstore_master: str) -> None:
    """1 KV head, TP=2: both ranks hold it, one shard; rank 0 writes it, rank 1 only reads it."""
    from tiny_models import make_tiny_checkpoint

    model = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny-llama-kv1"), dtype=torch.float32,
                                 num_key_value_heads=1)
    opts = {"master": kvstore_master, "namespace": "tp-engines-kv1", "wait_for_producer_s": 60.0}
    made: list[LLMEngine] = []
    pids: list[int] = []
    try:
        ref = _engine(model, None)
        made.append(ref)
        two = _engine(model, opts, tp=2)
        made.append(two)
        pids.extend(two.core.runner.pids.values())
        one = _engine(model, opts, tp=1)
        made.append(one)
        assert _layout(one).store_tp_size == _layout(two).store_tp_size == 1
        for tag, p, d in (("kv1-P2-D1", two, one), ("kv1-P1-D2", one, two)):
            prompts = _prompts(tag)
            want = _expected(ref, prompts)
            pre = generate(p, prompts, greedy(1), kv={rid: PREFILL_LEG for rid in prompts})
            dec = generate(d, prompts, greedy(MAX_TOKENS), prior={r: pre[r].outputs[0].token_ids for r in prompts},
                           kv={r: pre[r].kv_transfer_params.for_decode_leg() for r in prompts})
            for rid, prompt in prompts.items():
                assert pre[rid].outputs[0].token_ids + dec[rid].outputs[0].token_ids == want[rid], rid
                assert dec[rid].num_cached_tokens == len(prompt) // 16 * 16, rid
            settle(p)
            settle(d)
        # Rank 0 of the TP=2 instance wrote each of its prompt blocks once (as a consumer it
        # loaded blocks, which are never saved again).
        assert _worker_stats(two)["store_put_stored"] == sum(len(x) // 16 for x in _prompts("kv1-P2-D1").values())
    finally:
        for e in made:
            e.shutdown()
        for pid in wait_dead(pids, 10.0):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
