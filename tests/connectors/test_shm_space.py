"""A shared segment that the shared-memory folder has no room for is refused when it is made
(a sparse segment would SIGBUS the process once its pages outgrew the room: a container's
/dev/shm is 64 MiB by default), and a P2P worker then keeps its KV cache private and serves
same-host peers over TCP."""

from __future__ import annotations

import os
import random
from typing import Any

import pytest

from pdcluster.config import EngineArgs
from pdcluster.connectors import engine_connector_factory
from pdcluster.connectors.testing import PREFILL_LEG, assert_idle, decode_leg, run_requests
from pdcluster.engine.llm_engine import LLMEngine
from pdcluster.sampling_params import SamplingParams
from pdcluster.transfer import ShmSpaceError, alloc_region
from pdcluster.transfer import region as region_mod

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _ours() -> set[str]:
    return {n for n in os.listdir(region_mod.shm_dir()) if n.startswith(f"{region_mod.SHM_PREFIX}{os.getpid()}-")}


def test_a_segment_past_the_shared_memory_room_is_refused_when_made() -> None:
    before = _ours()
    too_big = region_mod.shm_free_bytes() + (1 << 30)
    with pytest.raises(ShmSpaceError, match="--shm-size") as e:
        alloc_region(too_big, shared=True)
    assert f"{too_big:,}" in str(e.value)
    assert _ours() == before  # nothing made, nothing left behind
    with alloc_region(1 << 20, shared=True) as fits:  # what fits is still made
        assert fits.shm_name and fits.nbytes == 1 << 20


def _engine(model: str, role: str | None, options: dict[str, Any] | None = None) -> LLMEngine:
    args = EngineArgs(model=model, num_kv_blocks=64, max_model_len=256, block_size=16,
                      enable_prefix_caching=role is not None, kv_connector="p2p" if role else None,
                      kv_role=role or "both", kv_connector_options=options)
    return LLMEngine.from_engine_args(args, connector=engine_connector_factory if role else None)


def test_a_worker_without_shared_memory_room_hands_off_over_tcp(demo_model: str, cluster_keys: Any,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """The producer starts where /dev/shm is full (its free space reads 0): it serves anyway, with a
    private cache, and a same-host consumer on transport auto pulls over TCP what decodes exactly
    as the aggregated engine does."""
    with monkeypatch.context() as m:
        m.setattr(region_mod, "shm_free_bytes", lambda: 0)
        producer = _engine(demo_model, "producer", cluster_keys.options("producer", engine_id="shm-full-producer"))
    engines = [producer]
    try:
        assert "kept in private memory" in caplog.text
        consumer = _engine(demo_model, "consumer", cluster_keys.options("consumer", engine_id="shm-full-consumer"))
        engines.append(consumer)
        ref = _engine(demo_model, None)
        engines.append(ref)
        rng = random.Random(7)
        prompt = [rng.randrange(3, 500) for _ in range(37)]
        pre = run_requests(producer, [("r", prompt, GREEDY.replace(max_tokens=1), PREFILL_LEG, None)], [])["r"]
        out = run_requests(consumer, [("r", prompt, GREEDY, decode_leg(pre), pre.outputs[0].token_ids)],
                           [producer])["r"]
        want = run_requests(ref, [("r", prompt, GREEDY, None, None)], [])["r"].outputs[0].token_ids
        assert pre.outputs[0].token_ids + out.outputs[0].token_ids == want
        stats = consumer.get_stats()["kv_connector"]
        assert stats["p2p_bytes_tcp"] > 0 and stats["p2p_bytes_shm"] == 0
        for name, engine in (("producer", producer), ("consumer", consumer)):
            assert_idle(engine, [], name)
    finally:
        for engine in engines:
            engine.shutdown()
