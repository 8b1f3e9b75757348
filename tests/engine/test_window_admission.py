"""Window-aware admission: the block arithmetic of kv_window.py against a brute force over
positions, admission / never_fits with and without a window, the scheduler capping a windowed
chunk to what the pool holds, and config accepting a pool smaller than max_model_len only when
every layer slides (and no KV connector keeps every block)."""

from __future__ import annotations

import pytest

from pdcluster.config import CacheConfig, SchedulerConfig
from pdcluster.engine.kv_window import first_needed_block, max_step_tokens, min_pool_blocks, step_blocks
from pdcluster.engine.outputs import ModelRunnerOutput
from pdcluster.engine.request import Request
from pdcluster.engine.request_limits import admission_error, never_fits
from pdcluster.engine.scheduler import Scheduler
from pdcluster.sampling_params import SamplingParams


def _held(c: int, n: int, w: int, bs: int) -> int:
    """Blocks holding a position some token in [c, c + n) reads or writes (brute force)."""
    read = set()
    for p in range(c, c + n):
        read.update(q // bs for q in range(max(0, p - w + 1), p + 1))
    # Blocks between the first read and the last written one are all held (contiguous tail).
    return max(read) - first_needed_block(c, w, bs) + 1 if read else 0


@pytest.mark.parametrize("w,bs", [(1, 4), (3, 4), (5, 2), (7, 3), (9, 4), (16, 16), (17, 5)])
def test_step_blocks_cover_what_a_step_reads(w: int, bs: int) -> None:
    worst = 0
    for c in range(0, 5 * w + 3 * bs):
        for n in range(1, 3 * bs):
            assert step_blocks(c, n, bs, w) == -(-(c + n) // bs) - first_needed_block(c, w, bs)
            assert step_blocks(c, n, bs, w) >= _held(c, n, w, bs)
        worst = max(worst, step_blocks(c, 1, bs, w))
        for pool in range(min_pool_blocks(w, bs), min_pool_blocks(w, bs) + 4):
            n = max_step_tokens(c, w, bs, pool)
            assert n >= 1 and step_blocks(c, n, bs, w) <= pool < step_blocks(c, n + 1, bs, w)
    assert worst == min_pool_blocks(w, bs)  # the bound is reached, never passed


def _req(n: int, max_tokens: int = 8) -> Request:
    return Request("r", list(range(3, 3 + n)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_admission_without_a_window_still_wants_the_whole_prompt() -> None:
    err = admission_error(_req(40), 100, 4, 9)
    assert err is not None and "needs 10 KV blocks for 40 tokens" in err and "window" not in err
    assert never_fits(40, 4, 9) == err
    assert admission_error(_req(36), 100, 4, 9) is None


def test_admission_with_a_window_wants_one_windows_blocks() -> None:
    # w=6, bs=4: min_pool_blocks = 3, whatever the length.
    assert admission_error(_req(90, 200), 400, 4, 3, sliding_window=6) is None
    err = admission_error(_req(90), 400, 4, 2, sliding_window=6)
    assert err is not None and "window of 6" in err and "3 KV blocks" in err
    assert admission_error(_req(3, 4), 400, 4, 2, sliding_window=6) is None  # 7 tokens: 2 blocks at most
    assert admission_error(_req(500), 400, 4, 3, sliding_window=6) is not None  # max_model_len still holds
    assert never_fits(200, 4, 3, 6, num_computed=199) is None
    assert "within its window" in never_fits(200, 4, 3, 6, num_computed=150)


def test_scheduler_caps_a_windowed_chunk_to_the_pool() -> None:
    sched = Scheduler(SchedulerConfig(4, 64, 400, True), CacheConfig(4, 5, 0, "float32", False),
                      sliding_window=6)
    sched.add_request(_req(90))
    seen = []
    while sched.requests:
        out = sched.schedule()
        seen.append(out.num_scheduled_tokens.get("r", 0))
        assert sched.kv.make_stats().num_used_blocks <= 5
        sched.update(out, ModelRunnerOutput(["r"], [[7]]))  # ignored for a prompt chunk
    assert sum(seen) == 90 + 8 - 1 and max(seen) <= 20 and sched.get_stats()["num_preemptions"] == 0
