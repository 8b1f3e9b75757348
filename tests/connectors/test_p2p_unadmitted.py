"""A decode leg handed a producer's KV that never enters the consumer's engine must still let the
producer's blocks go at once, not when the lease runs out: its caller went away before the engine
thread applied the add, its task was cancelled before it ran, or the consumer refused the request.
(Seen in CI: an Abort right after t0 left the prefill worker holding the lease to expiry.)

Real engines on 127.0.0.1: a P2P producer LLMEngine with a 120 s lease and a consumer
AsyncEngine on its own thread; each case must leave the producer idle within 20 s."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from pdcluster._proto import worker_pb2
from pdcluster.config import EngineArgs
from pdcluster.connectors import engine_connector_factory
from pdcluster.connectors.testing import PREFILL_LEG, assert_idle, decode_leg, run_requests
from pdcluster.engine.async_engine import AsyncEngine
from pdcluster.engine.llm_engine import LLMEngine
from pdcluster.sampling_params import SamplingParams
from pdcluster.worker.request_table import RequestTable
from pdcluster.worker.roles import AggregatedRole

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
RELEASED_WITHIN_S = 20.0  # far below the producer's 120 s lease


def _args(model: str, role: str, options: dict[str, Any], max_model_len: int = 256) -> EngineArgs:
    return EngineArgs(model=model, num_kv_blocks=64, max_model_len=max_model_len, block_size=16,
                      enable_prefix_caching=True, kv_connector="p2p", kv_role=role, kv_connector_options=options)


@pytest.fixture(scope="module")
def pair(demo_model: str, cluster_keys: Any) -> Iterator[tuple[LLMEngine, AsyncEngine]]:
    k = cluster_keys
    producer = LLMEngine.from_engine_args(
        _args(demo_model, "producer", k.options("producer", engine_id="ua-producer", lease_ttl_s=120.0)),
        connector=engine_connector_factory)
    # The consumer serves prompts up to 32 tokens: a longer decode leg is refused by the engine.
    # open_retry_s: how long a release retries a lease the producer has not registered yet; long,
    # so test_a_release_that_beats_the_lease holds on a slow machine.
    args = _args(demo_model, "consumer", k.options("consumer", engine_id="ua-consumer", transport="tcp",
                                                   open_retry_s=60.0), max_model_len=32)
    consumer = AsyncEngine(lambda: LLMEngine.from_engine_args(args, connector=engine_connector_factory))
    try:
        yield producer, consumer
    finally:
        consumer.shutdown()
        producer.shutdown()


def _held_prefill(producer: LLMEngine, request_id: str, n: int, seed: int) -> tuple[list[int], Any]:
    rng = random.Random(seed)
    prompt = [rng.randrange(3, 500) for _ in range(n)]
    pre = run_requests(producer, [(request_id, prompt, GREEDY.replace(max_tokens=1), PREFILL_LEG, None)],
                       [])[request_id]
    assert producer.get_stats()["num_held_for_transfer"] == 1
    return prompt, pre


def _assert_let_go(producer: LLMEngine) -> None:
    assert_idle(producer, [], "producer", timeout_s=RELEASED_WITHIN_S)
    assert producer.get_stats()["kv_connector"]["p2p_leases_active"] == 0


def test_caller_gone_before_the_engine_applied_the_add(pair: tuple[LLMEngine, AsyncEngine]) -> None:
    producer, consumer = pair
    prompt, pre = _held_prefill(producer, "ua-gone", 20, 1)

    async def leg() -> None:
        # The engine thread is held in a call, so the add the leg queues waits behind it; the
        # leg is cancelled meanwhile, and the engine thread finds its stream gone.
        hold = threading.Event()
        blocked = asyncio.ensure_future(consumer.call(lambda _engine: hold.wait(30)))
        outputs = consumer.generate(prompt, GREEDY, request_id="ua-gone", kv_transfer_params=decode_leg(pre),
                                    prefill_output_token_ids=pre.outputs[0].token_ids)
        first = asyncio.ensure_future(anext(outputs))
        for _ in range(20):  # no real I/O before the add is queued: a few loop turns reach it
            await asyncio.sleep(0)
        assert not first.done()
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await outputs.aclose()
        hold.set()
        await blocked

    asyncio.run(leg())
    _assert_let_go(producer)


def test_pump_cancelled_before_it_ran(pair: tuple[LLMEngine, AsyncEngine]) -> None:
    producer, consumer = pair
    prompt, pre = _held_prefill(producer, "ua-early", 20, 2)

    async def leg() -> None:
        table = RequestTable(consumer, AggregatedRole("p2p"))
        request = worker_pb2.WorkerGenerateRequest(request_id="ua-early", prompt_token_ids=prompt,
                                                   prefill_output_token_ids=pre.outputs[0].token_ids)
        task = table.start_pump("ua-early", request, GREEDY, decode_leg(pre), lambda item: False)
        task.cancel()  # before its first step: generate() never sees the params
        await asyncio.gather(task, return_exceptions=True)
        assert task.cancelled()

    asyncio.run(leg())
    _assert_let_go(producer)


def test_decode_leg_refused_by_the_consumer(pair: tuple[LLMEngine, AsyncEngine]) -> None:
    producer, consumer = pair
    prompt, pre = _held_prefill(producer, "ua-long", 40, 3)  # longer than the consumer's 32

    async def leg() -> None:
        outputs = consumer.generate(prompt, GREEDY, request_id="ua-long", kv_transfer_params=decode_leg(pre),
                                    prefill_output_token_ids=pre.outputs[0].token_ids)
        with pytest.raises(ValueError, match="max_model_len|32"):
            await anext(outputs)

    asyncio.run(leg())
    _assert_let_go(producer)


def test_a_completed_leg_is_released_once_and_the_pair_still_serves(pair: tuple[LLMEngine, AsyncEngine]) -> None:
    """The normal path is unchanged: the load is confirmed by the producer ("released"), a second
    settle of the same hand-off is a no-op, and the tokens are the producer's continuation."""
    producer, consumer = pair
    prompt, pre = _held_prefill(producer, "ua-ok", 20, 4)
    kv = decode_leg(pre)
    stop = threading.Event()
    stepper = threading.Thread(target=_step_until, args=(producer, stop), daemon=True)
    stepper.start()

    async def leg() -> list[int]:
        got: list[int] = []
        async for out in consumer.generate(prompt, GREEDY, request_id="ua-ok", kv_transfer_params=kv,
                                           prefill_output_token_ids=pre.outputs[0].token_ids):
            got += out.outputs[0].token_ids
        consumer.settle_handoff("ua-ok", kv)  # again: the engine took it, nothing more is sent
        return got

    try:
        got = asyncio.run(leg())
    finally:
        stop.set()
        stepper.join(10)
    stats = consumer.get_stats()["kv_connector"]
    assert stats["p2p_loads_ok"] >= 1 and stats["p2p_loads_failed"] == 0, stats
    assert len(got) == GREEDY.max_tokens - 1
    _assert_let_go(producer)


def test_a_release_that_beats_the_lease_is_retried(pair: tuple[LLMEngine, AsyncEngine]) -> None:
    """The producer registers a lease one engine step after its params left it. A decode leg that
    ends at once (here: refused) may tell the producer before that step: its "unknown" answer is
    not final, the release is retried until the lease exists, and the blocks go at once. The
    producer is not stepped until the consumer has been told "unknown" at least once, so the
    order is forced, not left to timing. (Seen in CI: such a release was dropped and the blocks
    stayed held to the 120 s lease expiry.)"""
    producer, consumer = pair

    async def retries() -> int:
        return (await consumer.call(lambda e: e.get_stats()))["kv_connector"]["p2p_release_retries"]

    async def leg(prompt: list[int], pre: Any) -> int:
        before = await retries()
        outputs = consumer.generate(prompt, GREEDY, request_id="ua-early-release", kv_transfer_params=decode_leg(pre),
                                    prefill_output_token_ids=pre.outputs[0].token_ids)
        with pytest.raises(ValueError, match="max_model_len|32"):
            await anext(outputs)
        for _ in range(3000):  # the producer is not stepped: its side channel answers "unknown"
            if await retries() > before:
                return before
            await asyncio.sleep(0.01)
        raise AssertionError("the consumer never retried the release of a lease the producer did not have yet")

    rng = random.Random(5)
    prompt = [rng.randrange(3, 500) for _ in range(40)]  # longer than the consumer's 32: refused
    request, text = producer.prepare_request(prompt, GREEDY.replace(max_tokens=1), "ua-early-release", PREFILL_LEG,
                                             None)
    producer.add_prepared(request, text)
    pre = None
    while pre is None:  # stop at the step that finished it: its lease is registered on the next one
        for out in producer.step():
            if out.finished:
                pre = producer.get_final(out.request_id)
    assert producer.get_stats()["kv_connector"]["p2p_leases_active"] == 0, "the lease was registered early"
    asyncio.run(leg(prompt, pre))
    _assert_let_go(producer)


def _step_until(engine: LLMEngine, stop: threading.Event) -> None:
    while not stop.is_set():
        if engine.has_unfinished_requests():
            engine.step()
        else:
            stop.wait(0.005)
