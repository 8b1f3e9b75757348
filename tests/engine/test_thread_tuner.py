"""The decode steps' thread count (engine/thread_tuner.py): the pure policy against scripted step
times (milliseconds, no clock), and a real engine whose outputs do not depend on the count it
picks (the tuner forced to switch counts every other step gives the tokens of a fixed count)."""

from __future__ import annotations

import pytest
import torch

from pdcluster import LLM, SamplingParams
from pdcluster.engine.thread_tuner import StepPlan, ThreadTuner, ladder, shape_key, step_key, step_plan


def test_ladder_and_shape_key() -> None:
    assert ladder(1) == (1,)
    assert ladder(2) == (2, 1)
    assert ladder(16) == (16, 8, 4, 2, 1)
    assert ladder(6) == (6, 3, 1)
    assert [shape_key(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 16]
    assert step_key(3, 3) == 4  # decode-only: by batch size
    assert step_key(3, 40) == -64 and step_key(1, 5) == -16  # with prefill tokens: by token count


def _drive(tuner: ThreadTuner, cost: dict[int, float], steps: int, key: int = 1) -> list[int]:
    picked = []
    for _ in range(steps):
        n = tuner.choose(key)
        tuner.record(key, n, cost[n])
        picked.append(n)
    return picked


def test_quiet_machine_keeps_all_threads_and_probes_rarely() -> None:
    tuner = ThreadTuner(2, explore_every=32)
    picked = _drive(tuner, {2: 0.012, 1: 0.019}, 32 * 40)
    assert picked[:4] == [2, 2, 1, 2] and tuner.best(1) == 2  # the first probe at the third step
    # The slower count is probed once per 32 steps; being clearly slower (1.6x), 4x less often:
    # 40 probe slots, ~10 probes.
    assert 2 <= picked.count(1) <= 11


def test_a_first_step_slowed_by_one_time_costs_does_not_send_the_key_to_fewer_threads() -> None:
    """A key's first step (the decode driver's plan built, new buffers touched) is not measured:
    as max's only sample it lost to the one-thread probe after it, and ~30 steps ran on one thread."""
    tuner = ThreadTuner(2, explore_every=32)
    costs = iter([0.030] + [0.0076] * 31)  # at 2 threads: the first step, then warm steps
    picked = []
    for _ in range(32):
        n = tuner.choose(1)
        tuner.record(1, n, next(costs) if n == 2 else 0.0116)
        picked.append(n)
    assert picked == [2, 2, 1] + [2] * 29
    assert tuner.snapshot()[1] == {2: pytest.approx(0.0076), 1: pytest.approx(0.0116)}


def test_contention_moves_to_fewer_threads_and_back_when_it_ends() -> None:
    tuner = ThreadTuner(2, explore_every=8)
    _drive(tuner, {2: 0.012, 1: 0.019}, 64)
    assert tuner.best(1) == 2
    busy = _drive(tuner, {2: 0.300, 1: 0.018}, 64)  # a competing process arrives
    assert tuner.best(1) == 1
    assert busy[-32:].count(1) >= 28  # settled: only probes run the slow count
    _drive(tuner, {2: 0.012, 1: 0.019}, 64)  # and leaves: one probe of 2 brings it back
    assert tuner.best(1) == 2


def test_keys_learn_apart_and_a_ladder_is_climbed_one_rung_at_a_time() -> None:
    tuner = ThreadTuner(8, explore_every=4)
    # batch 1 is fastest at 2 threads, batch 16 at 8: each key finds its own rung.
    costs = {1: {8: 0.05, 4: 0.03, 2: 0.01, 1: 0.02}, 16: {8: 0.02, 4: 0.03, 2: 0.05, 1: 0.09}}
    seen: dict[int, set[int]] = {1: set(), 16: set()}
    for _ in range(400):
        for key, cost in costs.items():
            n = tuner.choose(key)
            tuner.record(key, n, cost[n])
            seen[key].add(n)
    assert tuner.best(1) == 2 and tuner.best(16) == 8
    assert seen[16] == {8, 4}  # 8 was best from the start: only its neighbour was ever probed
    assert tuner.snapshot()[1][2] == pytest.approx(0.01)


def test_a_compiled_prefill_step_leaves_the_compiled_layers_only_for_another_count() -> None:
    """The compiled layers exist for the full count: a prefill key's smaller rung is the eager
    forward, so beside a busy process the one-thread eager step can win without a recompile."""
    tuner = ThreadTuner(2, explore_every=2)
    plans = [step_plan(tuner, -64, compiled_prefill=True) for _ in range(4)]
    assert plans[:2] == [StepPlan(2, False), StepPlan(1, True)]  # the second step probes 1 thread
    tuner = ThreadTuner(2, explore_every=2)
    assert [step_plan(tuner, 1, compiled_prefill=False) for _ in range(2)] == [StepPlan(2, False), StepPlan(1, False)]
    # Busy machine: the eager one-thread rung is measured faster and becomes the plan.
    tuner = ThreadTuner(2, explore_every=8)
    for _ in range(16):
        p = step_plan(tuner, -64, compiled_prefill=True)
        tuner.record(-64, p.threads, 0.9 if p.threads == 2 else 0.05)
    assert step_plan(tuner, -64, compiled_prefill=True) == StepPlan(1, True)


@pytest.fixture
def two_threads(monkeypatch: pytest.MonkeyPatch):
    """Two intra-op threads for the test (the tuner needs a count to choose from), restored after;
    a PDCLUSTER_NUM_THREADS or PDCLUSTER_ADAPTIVE_THREADS in the environment would override them."""
    monkeypatch.delenv("PDCLUSTER_NUM_THREADS", raising=False)
    monkeypatch.delenv("PDCLUSTER_ADAPTIVE_THREADS", raising=False)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


class _Recording(ThreadTuner):
    """A tuner that remembers what it picked."""

    def choose(self, key: int) -> int:
        n = super().choose(key)
        self.__dict__.setdefault("picked", []).append(n)
        return n


def test_outputs_do_not_depend_on_the_thread_count(tiny_ckpts, two_threads, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 (packed linears where this CPU packs them) and fp32: a tuner that switches between 2
    and 1 threads every other decode step gives the same greedy tokens as 2 threads throughout."""
    monkeypatch.setenv("PDCLUSTER_COMPILE", "0")
    model = tiny_ckpts("llama")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 100, (m,), generator=g).tolist() for m in (1, 7, 19, 33)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (20, 9, 14, 6)]
    for dtype in ("bfloat16", "float32"):
        runs = []
        for switching in (False, True):
            llm = LLM(model, compute_dtype=dtype, max_num_seqs=4, num_kv_blocks=64, block_size=8)
            runner = llm.engine.core.runner
            if switching:
                assert runner.thread_tuner is not None
                runner.thread_tuner = tuner = _Recording(2, explore_every=2)
            else:
                runner.thread_tuner = None
            runs.append([list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)])
            llm.shutdown()
        assert runs[0] == runs[1], dtype
        assert {1, 2} <= set(tuner.picked)  # both counts really ran


@pytest.mark.slow
def test_compiled_engine_switching_threads_neither_recompiles_nor_changes_tokens(
        tiny_ckpts, two_threads, monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps switch counts; a step with prefill tokens runs the compiled layers at the full count
    (dynamo guards on it) and eagerly at the other; no new graph, the same tokens."""
    monkeypatch.setenv("PDCLUSTER_COMPILE", "1")
    monkeypatch.setenv("PDCLUSTER_COMPILE_START", "wait")
    from torch._dynamo.utils import counters

    model = tiny_ckpts("llama")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 100, (m,), generator=g).tolist() for m in (5, 23, 40, 12)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (8, 5, 11, 6)]
    runs = []
    for switching in (False, True):
        llm = LLM(model, compute_dtype="float32", max_num_seqs=2, max_num_batched_tokens=16,
                  num_kv_blocks=64, block_size=8)
        runner = llm.engine.core.runner
        runner.thread_tuner = _Recording(2, explore_every=2) if switching else None
        graphs = counters["stats"]["unique_graphs"]
        runs.append([list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)])
        assert runner.forward_fn.compiled_steps > 0
        assert counters["stats"]["unique_graphs"] == graphs, (switching, graphs)  # no recompile
        if switching:
            assert {1, 2} <= set(runner.thread_tuner.picked)
            assert runner.forward_fn.eager_prefill_steps > 0  # prefill steps on one thread: eager
        else:
            assert runner.forward_fn.eager_prefill_steps == 0
        llm.shutdown()
    assert runs[0] == runs[1]


class _OneThread(ThreadTuner):
    """A tuner that picks one thread for every step."""

    def choose(self, key: int) -> int:
        return 1


def test_shutdown_puts_back_the_thread_count_the_tuner_changed(tiny_ckpts, two_threads, monkeypatch) -> None:
    """The count is process-wide: an engine whose last step ran on one thread must not leave the
    next engine of the process (which takes its ceiling from the current count) without a tuner."""
    monkeypatch.setenv("PDCLUSTER_COMPILE", "0")
    model = tiny_ckpts("llama")
    llm = LLM(model, compute_dtype="float32", max_num_seqs=2, num_kv_blocks=32, block_size=8)
    llm.engine.core.runner.thread_tuner = _OneThread(2)
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert torch.get_num_threads() == 1  # the tuner's last pick is in force
    llm.shutdown()
    assert torch.get_num_threads() == 2
    llm = LLM(model, compute_dtype="float32", max_num_seqs=2, num_kv_blocks=32, block_size=8)
    try:
        assert llm.engine.core.runner.thread_tuner is not None
        assert llm.engine.core.runner.thread_tuner.max_threads == 2
    finally:
        llm.shutdown()
