"""A TP instance whose rank dies goes down cleanly: requests in flight end with a clear error in
bounded time, the engine reports unhealthy and refuses new work, and no rank process is left."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
from distributed.tp_procs import alive, children_of, wait_dead
from engine_hold import EngineHold

from pdcluster.config import EngineArgs
from pdcluster.engine.async_engine import AsyncEngine, EngineDeadError
from pdcluster.sampling_params import SamplingParams


def test_killed_rank_fails_requests_and_engine(tiny_ckpt, started_pids) -> None:
    engine = AsyncEngine.from_engine_args(EngineArgs(
        model=tiny_ckpt("llama"), num_kv_blocks=48, tensor_parallel_size=2, tp_collective_timeout_s=20))
    pids = list(engine.engine.core.runner.pids.values())
    started_pids.extend(pids)

    async def scenario() -> tuple[list, float]:
        sp = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        outs = []
        killed_at = 0.0
        # Held after 3 outputs, so the kill lands mid-request however fast the machine; then
        # stepping again runs into the dead rank.
        with EngineHold(engine, "tp-kill", after=3) as hold:
            async for out in engine.generate([5, 6, 7], sp, request_id="tp-kill"):
                outs.append(out)
                if len(outs) == 3:  # streaming: kill rank 1 mid-request
                    os.kill(pids[0], signal.SIGKILL)
                    killed_at = time.monotonic()
                    hold.release()
        return outs, time.monotonic() - killed_at

    try:
        assert engine.is_healthy
        outs, took = asyncio.run(asyncio.wait_for(scenario(), 60))
        last = outs[-1]
        assert last.finished and last.outputs[0].finish_reason == "error"
        assert "rank 1" in last.error and "SIGKILL" in last.error, last.error
        assert took < 10.0  # bounded: a dead peer breaks the collective, no timeout wait
        assert not engine.is_healthy

        async def again() -> None:
            async for _ in engine.generate([1, 2], SamplingParams(max_tokens=2)):
                pass

        with pytest.raises(EngineDeadError, match="rank 1"):
            asyncio.run(again())
    finally:
        engine.shutdown()
    assert wait_dead(pids, 10.0) == []


def test_stopped_rank_takes_the_instance_down(tiny_ckpt, started_pids) -> None:
    """SIGSTOP of rank 1 mid-request: alive to waitpid, silent to every collective. The launcher
    sees the stop (waitid WSTOPPED), and once the rank stays stopped past its grace it reports it
    and kills it, so the step blocked on it fails with an error naming the rank, long before the
    collective timeout (600 s here), and the engine is down instead of looking healthy."""
    engine = AsyncEngine.from_engine_args(EngineArgs(
        model=tiny_ckpt("llama"), num_kv_blocks=48, tensor_parallel_size=2, tp_collective_timeout_s=600))
    pids = list(engine.engine.core.runner.pids.values())
    started_pids.extend(pids)

    async def scenario() -> list:
        sp = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        outs = []
        with EngineHold(engine, "tp-stop", after=3) as hold:
            async for out in engine.generate([5, 6, 7], sp, request_id="tp-stop"):
                outs.append(out)
                if len(outs) == 3:
                    os.kill(pids[0], signal.SIGSTOP)
                    hold.release()
        return outs

    try:
        outs = asyncio.run(asyncio.wait_for(scenario(), 120))
        last = outs[-1]
        assert last.finished and last.outputs[0].finish_reason == "error"
        assert "rank 1" in last.error and "stopped by SIGSTOP" in last.error, last.error
        assert not engine.is_healthy
    finally:
        engine.shutdown()
    assert wait_dead(pids, 10.0) == []


def test_idle_rank_death_is_noticed_without_a_request(tiny_ckpt, started_pids) -> None:
    engine = AsyncEngine.from_engine_args(EngineArgs(model=tiny_ckpt("qwen2"), num_kv_blocks=48,
                                                     tensor_parallel_size=2))
    pids = list(engine.engine.core.runner.pids.values())
    started_pids.extend(pids)
    try:
        os.kill(pids[0], signal.SIGKILL)
        end = time.monotonic() + 5.0
        while engine.is_healthy and time.monotonic() < end:
            time.sleep(0.05)
        assert not engine.is_healthy
        assert "exited with signal SIGKILL" in engine.engine.core.health_error()
    finally:
        engine.shutdown()
    assert wait_dead(pids, 10.0) == []


_RANK0 = """
import sys, time
from pdcluster import LLM
llm = LLM(sys.argv[1], num_kv_blocks=48, tensor_parallel_size=2)
print(" ".join(map(str, llm.engine.core.runner.pids.values())), flush=True)
time.sleep(600)
"""


def test_killed_rank0_takes_its_ranks_with_it(tiny_ckpt, started_pids) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _RANK0, tiny_ckpt("llama")], stdout=subprocess.PIPE, text=True)
    started_pids.append(proc.pid)
    line = proc.stdout.readline()
    ranks = [int(p) for p in line.split()]
    started_pids.extend(ranks)
    assert ranks and ranks == children_of(proc.pid) and all(alive(p) for p in ranks)
    proc.kill()  # SIGKILL: no finalizer, no shutdown message; the rank sees its stdin close
    proc.wait(10)
    assert wait_dead(ranks, 10.0) == []
