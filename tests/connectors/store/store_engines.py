"""In-process engines with the store connector, and a loop that steps them (test helpers)."""

from __future__ import annotations

import time
from typing import Any

from pdcluster.config import EngineArgs
from pdcluster.connectors import engine_connector_factory
from pdcluster.engine.kv_connector import KVTransferParams
from pdcluster.engine.llm_engine import LLMEngine
from pdcluster.engine.outputs import RequestOutput
from pdcluster.sampling_params import SamplingParams


def make_engine(model: str, options: dict[str, Any] | None, *, num_blocks: int = 64, role: str = "both",
                tp: int = 1, max_model_len: int = 512) -> LLMEngine:
    """tp > 1: rank 0 runs here, ranks 1.. are child processes (engine.core.runner.pids)."""
    args = EngineArgs(model=model, num_kv_blocks=num_blocks, max_model_len=max_model_len, block_size=16, seed=0,
                      dtype="float32", kv_connector="store" if options is not None else None, kv_role=role,
                      kv_connector_options=options, tensor_parallel_size=tp)
    return LLMEngine.from_engine_args(args, connector=engine_connector_factory if options is not None else None)


def greedy(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def generate(engine: LLMEngine, prompts: dict[str, list[int]], sp: SamplingParams | None = None,
             timeout_s: float = 120.0, kv: dict[str, KVTransferParams] | None = None,
             prior: dict[str, list[int]] | None = None) -> dict[str, RequestOutput]:
    """kv / prior: per request id, kv_transfer_params and prefill_output_token_ids (a decode leg)."""
    for rid, prompt in prompts.items():
        req, text = engine.prepare_request(prompt, sp or greedy(), rid, (kv or {}).get(rid), (prior or {}).get(rid))
        engine.add_prepared(req, text)
    done: dict[str, RequestOutput] = {}
    deadline = time.monotonic() + timeout_s
    while len(done) < len(prompts):
        assert time.monotonic() < deadline, f"requests {set(prompts) - set(done)} did not finish"
        for out in engine.step():
            if out.finished:
                done[out.request_id] = engine.get_final(out.request_id)
    return done


def settle(engine: LLMEngine, timeout_s: float = 30.0) -> None:
    """Step until every block is back (saves written, holds released)."""
    deadline = time.monotonic() + timeout_s
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, f"engine did not settle: {engine.get_stats()}"
        engine.step()
    assert engine.get_stats()["kv_blocks_used"] == 0


def wait_events(engine: LLMEngine, num_stored: int, timeout_s: float = 10.0) -> list[Any]:
    """Collect the engine's KV events until `num_stored` BlockStored hashes came from the store."""
    from pdcluster.engine.block_pool import BlockStored

    events: list[Any] = []
    deadline = time.monotonic() + timeout_s
    while sum(len(e.block_hashes) for e in events if isinstance(e, BlockStored)) < num_stored:
        assert time.monotonic() < deadline, f"only {events} after {timeout_s}s"
        events.extend(engine.core.connector.take_events())
        time.sleep(0.02)
    return events
