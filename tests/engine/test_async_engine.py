"""AsyncEngine: streamed deltas add up to the offline result; cancel/abort frees every block."""

from __future__ import annotations

import asyncio

import pytest
from engine_hold import EngineHold

from pdcluster import LLM, SamplingParams
from pdcluster.config import EngineArgs
from pdcluster.engine.async_engine import AsyncEngine


@pytest.fixture(scope="module")
def engine(demo_model: str):
    eng = AsyncEngine.from_engine_args(EngineArgs(model=demo_model, max_model_len=256))
    yield eng
    eng.shutdown()


async def _collect(engine: AsyncEngine, prompt, sp, rid):
    text, toks, last = "", [], None
    async for out in engine.generate(prompt, sp, request_id=rid):
        text += out.outputs[0].text
        toks += out.outputs[0].token_ids
        last = out
    return text, toks, last


def test_stream_equals_offline(engine: AsyncEngine, demo_model: str) -> None:
    prompts = ["Hello, world!", "The quick brown fox", "東京 🙂 café"]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    offline = LLM(demo_model, max_model_len=256).generate(prompts, sp)

    async def main():
        return await asyncio.gather(*[_collect(engine, p, sp, f"s{i}") for i, p in enumerate(prompts)])

    results = asyncio.run(main())
    for (text, toks, last), ref in zip(results, offline):
        assert toks == ref.outputs[0].token_ids
        assert text == ref.outputs[0].text
        assert last.finished and last.outputs[0].finish_reason == "length"


def test_cancel_mid_stream_frees_blocks(engine: AsyncEngine) -> None:
    sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        seen = 0
        async for _ in engine.generate("a long generation that we cancel", sp, request_id="cancel-me"):
            seen += 1
            if seen == 3:
                break  # closing the generator aborts the request
        for _ in range(1500):  # up to 30 s on a slow machine
            stats = engine.get_stats()
            if stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["kv_blocks_used"] == 0:
                return stats
            await asyncio.sleep(0.02)
        return engine.get_stats()

    with EngineHold(engine, "cancel-me", after=3):  # still running when cancelled, however fast the machine
        stats = asyncio.run(main())
    assert stats["num_running"] == 0 and stats["kv_blocks_used"] == 0, stats


def test_bad_request_and_duplicate_id(engine: AsyncEngine) -> None:
    async def main():
        with pytest.raises(ValueError, match="prompt"):
            async for _ in engine.generate("", SamplingParams(max_tokens=4), request_id="bad"):
                pass
        sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        gen = engine.generate("dup", sp, request_id="dup")
        first = await gen.__anext__()
        with pytest.raises(ValueError, match="already in flight"):
            async for _ in engine.generate("dup", sp, request_id="dup"):
                pass
        rest = [first] + [o async for o in gen]
        assert rest[-1].finished
        _, toks, _ = await _collect(engine, "after errors", sp, "ok")
        assert len(toks) == 30

    asyncio.run(main())
