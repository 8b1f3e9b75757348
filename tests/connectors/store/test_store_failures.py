"""Store failures never give wrong tokens: a block gone between lookup and read is recomputed
(default policy) or fails the request loudly ("fail"); a step whose saves overflow the staging
arena is saved in chunks after its forward."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest
from store_engines import generate, greedy, make_engine, settle, wait_events


def _worker(engine: Any) -> Any:
    return engine.core.runner.connector_hooks.connector._worker


@pytest.fixture(scope="module")
def stored(demo_model: str, kvstore_master: str) -> tuple[list[int], list[int]]:
    """A prompt whose first 4 blocks are in the store, and its reference output."""
    prompt = [random.Random(3).randrange(3, 500) for _ in range(4 * 16 + 5)]
    a = make_engine(demo_model, {"master": kvstore_master, "namespace": "failures"})
    ref = make_engine(demo_model, None)
    try:
        generate(a, {"a": prompt}, greedy(1))
        settle(a)
        wait_events(a, 4)
        want = generate(ref, {"r": prompt})["r"].outputs[0].token_ids
    finally:
        a.shutdown()
        ref.shutdown()
    return prompt, want


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_block_gone_between_lookup_and_read(demo_model: str, kvstore_master: str, stored: Any, policy: str) -> None:
    prompt, want = stored
    b = make_engine(demo_model, {"master": kvstore_master, "namespace": "failures", "failure_policy": policy})
    backend = _worker(b)._backend
    real = backend.batch_get_into

    def evicted_after_two(keys: Sequence[str], bufs: Sequence[Any]) -> list[bool]:
        ok = real(keys, bufs)
        n = len({k.rsplit("@", 1)[1] for k in keys})  # blocks; keys are shard-major runs of them
        return [good and i % n < 2 for i, good in enumerate(ok)]  # blocks 2 and 3 are gone

    backend.batch_get_into = evicted_after_two
    try:
        out = generate(b, {"b": prompt})["b"]
        settle(b)
        stats = b.get_stats()["kv_connector"]
        assert stats["store_load_failed_blocks"] == 2
        if policy == "recompute":
            assert out.error is None and out.outputs[0].token_ids == want
        else:
            assert out.outputs[0].finish_reason == "error" and "KV transfer failed" in out.error
    finally:
        b.shutdown()


def test_step_larger_than_staging_is_saved_in_chunks(demo_model: str, kvstore_master: str) -> None:
    prompts = {k: [random.Random(k).randrange(3, 500) for _ in range(10 * 16)] for k in "xy"}
    # 1 MiB of staging holds 16 of the demo model's 64 KiB objects; both 10-block prefills run in
    # one step, so its 20-block save does not fit: packed after the forward, 16 + 4, none lost.
    # tp_sizes=[1]: one object per block (by default blocks are cut into the shards TP 1..8 share).
    e = make_engine(demo_model, {"master": kvstore_master, "namespace": "staging", "save_staging_mib": 1,
                                 "tp_sizes": [1]})
    ref = make_engine(demo_model, None)
    try:
        got = generate(e, prompts)
        settle(e)
        want = generate(ref, prompts)
        assert [got[k].outputs[0].token_ids for k in "xy"] == [want[k].outputs[0].token_ids for k in "xy"]
        stats = e.get_stats()["kv_connector"]
        assert stats["store_save_blocks"] == 20
        assert stats["store_save_dropped_blocks"] == 0 and stats["store_put_stored"] == 20
    finally:
        e.shutdown()
        ref.shutdown()


def test_idle_steps_wake_when_a_store_transfer_ends(demo_model: str, kvstore_master: str, stored: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The store's load and save threads wake an engine waiting in an idle step: with the idle
    poll stretched to an hour, a request whose prefix loads from the store (and whose new blocks
    are saved) still runs to the end, token-exact, and the engine settles."""
    import threading

    from pdcluster.engine import engine_core

    prompt, want = stored
    b = make_engine(demo_model, {"master": kvstore_master, "namespace": "failures"})
    woken = [0]

    def wake() -> None:
        woken[0] += 1
        b.core.wake()
    try:
        b.core.runner.connector_hooks.connector.set_wakeup(wake)
        monkeypatch.setattr(engine_core, "_IDLE_STEP_S", 3600.0)
        result: dict[str, Any] = {}

        def run() -> None:
            result["out"] = generate(b, {"w": prompt})["w"]
            settle(b)
        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(120.0)
        assert not t.is_alive(), "an idle step was not woken when its store transfer ended"
        monkeypatch.undo()
        out = result["out"]
        assert out.error is None and out.outputs[0].token_ids == want
        assert b.get_stats()["kv_connector"]["store_load_blocks"] == 4 and woken[0] >= 1
    finally:
        monkeypatch.undo()
        b.shutdown()
