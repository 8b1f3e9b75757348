"""P2P hand-off of a sliding-window model with blocks behind the window freed on both engines:
the producer leases only the prompt blocks a decode leg can still read, the consumer places
placeholders before them and loads the rest; disaggregated output equals aggregated, token for
token, for prompts longer than the window (with a chunked producer that freed blocks before it
finished, and after local prefix hits on the consumer). The store connector keeps freeing off."""

from __future__ import annotations

import random
from typing import Any

import pytest

from pdcluster.config import EngineArgs
from pdcluster.connectors import engine_connector_factory
from pdcluster.connectors.testing import PREFILL_LEG, assert_idle, decode_leg, run_requests
from pdcluster.engine.kv_window import first_needed_block
from pdcluster.engine.llm_engine import LLMEngine
from pdcluster.sampling_params import SamplingParams

BS, WINDOW = 3, 7
GREEDY = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)


def _engine(model: str, role: str | None, options: dict[str, Any] | None = None, **kw: Any) -> LLMEngine:
    args = EngineArgs(model=model, dtype="float32", device="cpu", num_kv_blocks=48, max_model_len=128,
                      block_size=BS, enable_prefix_caching=True, kv_connector="p2p" if role else None,
                      kv_role=role or "both", kv_connector_options=options, **kw)
    return LLMEngine.from_engine_args(args, connector=engine_connector_factory if role else None)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory, cluster_keys: Any) -> Any:
    from models.tiny_archs import make_checkpoint

    path = make_checkpoint("mistral", tmp_path_factory.mktemp("p2pwin"), sliding_window=WINDOW,
                           max_position_embeddings=128)
    k = cluster_keys
    made = {"ref": _engine(path, None),
            # Chunks of 5: the producer frees blocks behind its window before its prompt is done.
            "producer": _engine(path, "producer", k.options("producer", engine_id="win-producer", lease_ttl_s=5.0),
                                max_num_batched_tokens=5),
            "consumer": _engine(path, "consumer", k.options("consumer", engine_id="win-consumer",
                                                            transport="tcp", open_retry_s=0.5))}
    yield made
    for e in made.values():
        e.shutdown()


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


def test_windowed_handoff_equals_aggregated(engines: Any) -> None:
    producer, consumer = engines["producer"], engines["consumer"]
    for e in (producer, consumer, engines["ref"]):
        assert e.core.scheduler.kv.sliding_window == WINDOW  # freeing is on with the P2P connector
    base = _prompt(23, 1)
    cases = [("base", base), ("longer", base + _prompt(14, 2)), ("short", _prompt(5, 3))]  # last: within the window
    m = consumer.config.model
    block_bytes = 2 * m.num_hidden_layers * BS * m.num_key_value_heads * m.head_dim * 4  # float32 K and V
    for rid, prompt in cases:
        before = consumer.get_stats()["kv_connector"]["p2p_bytes_tcp"]
        pre = run_requests(producer, [(rid, prompt, GREEDY.replace(max_tokens=1), PREFILL_LEG, None)], [])[rid]
        kv = decode_leg(pre)
        out = run_requests(consumer, [(rid, prompt, GREEDY, kv, pre.outputs[0].token_ids)], [producer])[rid]
        got = pre.outputs[0].token_ids + out.outputs[0].token_ids
        ref = run_requests(engines["ref"], [("ref-" + rid, prompt, GREEDY, None, None)], [])["ref-" + rid]
        assert got == ref.outputs[0].token_ids, rid
        if rid == "base":  # no local hits: blocks [first_needed(P), ceil(P/bs)) = [5, 8), not all 8
            moved = consumer.get_stats()["kv_connector"]["p2p_bytes_tcp"] - before
            assert moved == (-(-len(prompt) // BS) - first_needed_block(len(prompt), WINDOW, BS)) * block_bytes == 3 * block_bytes
    stats = consumer.get_stats()
    assert stats["num_preemptions"] == 0
    for name in ("producer", "consumer"):
        assert_idle(engines[name], [], name)


def test_lease_covers_only_the_window_tail() -> None:
    from pdcluster.connectors.p2p.scheduler_side import P2PScheduler

    for p, w, bs in [(23, 7, 3), (37, 7, 3), (5, 7, 3), (40, 16, 4), (9, 1, 4)]:
        s = P2PScheduler.__new__(P2PScheduler)
        s.window, s.block_size = w, bs
        start = s._lease_start(p)
        assert start == first_needed_block(p - 1, w, bs)
        # Everything the decode leg's first token (position p-1 or p) reads is at or after it.
        assert start * bs <= max(0, p - 1 - w + 1)


def test_store_connector_keeps_freeing_off() -> None:
    from pdcluster.connectors.p2p.connector import P2PConnector
    from pdcluster.connectors.store.connector import StoreConnector

    assert P2PConnector.frees_behind_window and not StoreConnector.frees_behind_window
