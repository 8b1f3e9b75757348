"""How many intra-op (OpenMP) threads an engine step gets, chosen from measured step times.

Why: on a CPU the decode step of a small batch is hundreds of tiny parallel regions (GEMVs,
attention products), each ending in a barrier where every thread must arrive. When another busy
process shares the cores, one of the engine's threads is descheduled for a scheduler slice at a
time and the others wait at each barrier for it: measured on a 2-vCPU EPYC with one competing
busy process, a batch-1 decode step took 323 ms with 2 threads and 20 ms with 1 (13 ms with 2
on a quiet machine); batch 8: 58 ms with 2 threads, 32 with 1 (RESULTS.md, session 4).
No fixed count is right for both a quiet and a shared machine, so the engine measures.

Policy (pure, deterministic, no clock of its own): steps are keyed by their shape (decode-only:
batch size rounded up to a power of two; with prefill tokens: token count, likewise). Thread
counts form a ladder max, max/2, ..., 1. Each key keeps an exponentially weighted mean step time
per count it tried, starts at max, and at its third step and every `explore_every` steps after
tries one neighbour of its current best on the ladder (the next smaller and larger count, in
turn), so a change of the machine's load is noticed within a few dozen steps while a quiet
machine pays one probe step in `explore_every` (a neighbour clearly slower than the best is
probed four times less often). A key's first step is not measured: it carries the shape's
one-time costs (the decode driver's plan, first touches of new buffers), and as the only sample
of max it lost to the one-thread probe after it, so a quiet 2-core machine ran the next ~20-30
batch-1 decode steps on one thread at 1.5x their time (benchmarks/decode_roofline.py's first
block: first step 11.7 ms at 2 threads, probe 11.6 at 1, then 7.6 at 2 once warm).

Thread counts do not change results: the products split their output, not their reduction
(checked bit for bit at 1 and 2 threads, tests/engine/test_thread_tuner.py), so greedy outputs
are the same whatever the tuner picks. Steps with prefill tokens are tuned too (serving beside a
busy process, steps mixing a prefill chunk with decodes ran at ~950 ms with 2 threads). The
compiled layers (compiled_forward.py) exist for the full count only: dynamo guards on the thread
count (GLOBAL_STATE num_threads), so another count would compile them again mid-serving. So for
a step with prefill tokens on a compiled forward the ladder's rungs mean: the full count runs the
compiled layers, a smaller count runs the same step eagerly (step_plan). On a quiet machine the
compiled rung wins and the probes cost one eager step in explore_every; beside a busy process
the eager one-thread rung wins without any recompile.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ALPHA = 0.25  # weight of a new sample in a count's mean step time
EXPLORE_EVERY = 32  # steps of one key between two probes of a neighbouring count
FIRST_PROBE_STEP = 3  # a key's first probe: after one measured step of max (its first is not measured)
CLEARLY_SLOWER = 1.5  # a neighbour this much slower than the best is probed 4x less often


def ladder(max_threads: int) -> tuple[int, ...]:
    """max, max/2, ..., 1 (descending, distinct)."""
    out = []
    n = max(1, max_threads)
    while n > 1:
        out.append(n)
        n //= 2
    out.append(1)
    return tuple(out)


def shape_key(n: int) -> int:
    """n rounded up to a power of two: steps of similar cost share their statistics."""
    return 1 << max(0, n - 1).bit_length()


def step_key(num_reqs: int, num_tokens: int) -> int:
    """A decode-only step is keyed by its batch size (1, 2, 4, ...), a step with prefill tokens
    by its token count (negative: -16, -32, ..., so the two never share a key)."""
    return shape_key(num_reqs) if num_tokens == num_reqs else -shape_key(max(num_tokens, 16))


@dataclass
class _KeyState:
    means: dict[int, float] = field(default_factory=dict)  # threads -> EWMA step seconds
    steps: int = 0
    probes: int = 0  # probes so far: alternates the neighbour probed


@dataclass
class ThreadTuner:
    max_threads: int
    explore_every: int = EXPLORE_EVERY
    alpha: float = ALPHA
    _keys: dict[int, _KeyState] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.counts = ladder(self.max_threads)

    def best(self, key: int) -> int:
        """The count with the lowest mean step time for this key (max until measured)."""
        means = self._keys[key].means if key in self._keys else {}
        return min(means, key=means.__getitem__) if means else self.counts[0]

    def choose(self, key: int) -> int:
        """Thread count for the next step of this shape."""
        state = self._keys.setdefault(key, _KeyState())
        state.steps += 1
        best = self.best(key)
        # The first probe comes early, at a key's third step: a key may see few steps (under a
        # busy neighbour a step can take a second, and each shape has its own key).
        if len(self.counts) == 1 or (state.steps != FIRST_PROBE_STEP and state.steps % self.explore_every):
            return best
        i = self.counts.index(best)
        neighbours = [self.counts[j] for j in (i + 1, i - 1) if 0 <= j < len(self.counts)]
        state.probes += 1
        probe = neighbours[state.probes % len(neighbours)]
        means = state.means
        slow = probe in means and best in means and means[probe] > CLEARLY_SLOWER * means[best]
        if slow and (state.steps // self.explore_every) % 4:
            return best
        return probe

    def record(self, key: int, threads: int, seconds: float) -> None:
        """A step of this shape took `seconds` with `threads` threads. The count in use averages
        its samples; a probe replaces its count's mean (that mean is as old as the last probe,
        and the load it measured may be gone: after contention ends, one probe brings max back).
        The key's first step is left out (module docstring: its one-time costs)."""
        state = self._keys.setdefault(key, _KeyState())
        if state.steps <= 1:
            return
        best = self.best(key)
        means = state.means
        old = means.get(threads)
        means[threads] = seconds if old is None or threads != best else old + self.alpha * (seconds - old)

    def snapshot(self) -> dict[int, dict[int, float]]:
        """{key: {threads: mean step seconds}}, for logs and stats."""
        return {k: dict(s.means) for k, s in self._keys.items()}


@dataclass(frozen=True)
class StepPlan:
    threads: int
    eager: bool  # run a step with prefill tokens eagerly instead of on the compiled layers


def step_plan(tuner: ThreadTuner, key: int, compiled_prefill: bool) -> StepPlan:
    """The next step's thread count, and whether it leaves the compiled layers: a step with
    prefill tokens on a compiled forward (`compiled_prefill`) runs compiled only at the count the
    layers were compiled for (the full one), eagerly at any other."""
    threads = tuner.choose(key)
    return StepPlan(threads, compiled_prefill and threads != tuner.max_threads)
