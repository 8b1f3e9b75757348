"""How many of its n-gram drafts each request checks in a step: pure policy, no clock of its own.

Why: a draft is a bet. Checking k drafts adds k rows to the step; it pays when the tokens the
drafts are expected to yield are worth more than what the rows cost. Both sides vary: a repetitive
request keeps most of its drafts, free text few; a decode row costs almost nothing while a step is
bound by the weight read (batch 1-3 of the 125M Llama on a 2-core AVX2 CPU: 7.4 -> 8.2 ms from 1 to
3 rows) and its full share once it is bound by arithmetic (a 5M-parameter model, or a batch of 8:
each row adds ~1/8 of the step). vLLM checks every draft it finds; here the engine measures both
sides and checks a draft only when it raises the step's expected tokens per second.

Inputs, fed by the scheduler: the time of each decode-shaped step by its number of rows (one row
per token: EngineCore times the runner), and each request's drafts checked and kept. A row count's
first step is not a price (it carries that shape's one-time costs: the thread tuner's first step
of a key, buffers), and a step far above its count's average (the tuner's one-thread probe, a
neighbour's burst) counts as SPIKE times the average: a row count that rarely runs would otherwise
keep a price that a single outlier set, and the policy would stop checking the drafts that would
measure it again. Estimates:

    t(r)     step seconds at r rows: a moving average per row count, made non-decreasing in r
             (a step of more rows never costs less: sub-millisecond steps are noisy enough to say
             otherwise), linear between measured counts, the last slope past the largest (flat
             while fewer than two are known: an optimistic start that gets larger counts measured)
    a        a request's share of drafts kept: its own decayed counts, smoothed toward the
             engine-wide share (a new request starts from what the workload has been keeping)

Rule, greedy over requests in order of a (best first) and their drafts in order: the j-th draft
of a request is kept with probability a^j (all before it kept), so it adds a^j expected tokens
for t(r + 1) - t(r) seconds; it is checked when that rate is at least the step's expected tokens
per second so far (E / t(r)). Every EXPLORE_EVERY-th step one request (in turn) checks its
first draft anyway, so a share that was low once is measured again, for one row in that step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ALPHA = 0.2  # weight of a new step time in its row count's average
DECAY = 0.7  # a request's kept/checked counts are multiplied by this before each new check
PRIOR_WEIGHT = 2.0  # draft checks' worth of the engine-wide share in a request's estimate
GLOBAL_ALPHA = 0.05  # weight of one check in the engine-wide share
START_SHARE = 0.6  # the engine-wide share before any check
EXPLORE_EVERY = 16
SPIKE = 1.25  # a step counts at most this much above its row count's average


@dataclass
class DraftPolicy:
    max_drafts: int
    adaptive: bool = True
    step_s: dict[int, float] = field(default_factory=dict)  # rows -> average seconds
    share: float = START_SHARE  # engine-wide share of drafts kept
    _counts: dict[str, tuple[float, float]] = field(default_factory=dict)  # request -> (kept, checked)
    _steps: int = 0
    _seen: set[int] = field(default_factory=set)  # row counts whose first step went by

    # -- measurements ----------------------------------------------------------------------------
    def record_step(self, rows: int, seconds: float) -> None:
        if rows not in self._seen:  # its one-time costs: not a price (module docstring)
            self._seen.add(rows)
            return
        old = self.step_s.get(rows)
        self.step_s[rows] = seconds if old is None else old + ALPHA * (min(seconds, SPIKE * old) - old)

    def record_check(self, request_id: str, checked: int, kept: int) -> None:
        if checked <= 0:
            return
        k, c = self._counts.get(request_id, (0.0, 0.0))
        self._counts[request_id] = (k * DECAY + kept, c * DECAY + checked)
        self.share += GLOBAL_ALPHA * (kept / checked - self.share)

    def forget(self, request_id: str) -> None:
        self._counts.pop(request_id, None)

    # -- estimates -------------------------------------------------------------------------------
    def kept_share(self, request_id: str) -> float:
        k, c = self._counts.get(request_id, (0.0, 0.0))
        return (k + PRIOR_WEIGHT * self.share) / (c + PRIOR_WEIGHT)

    def _monotone(self) -> dict[int, float]:
        out: dict[int, float] = {}
        best = 0.0
        for r in sorted(self.step_s):
            best = max(best, self.step_s[r])
            out[r] = best
        return out

    def step_time(self, rows: int, known: dict[int, float] | None = None) -> float | None:
        """t(rows), or None when nothing is measured yet. known: _monotone(), if already made."""
        known = self._monotone() if known is None else known
        if not known:
            return None
        if rows in known:
            return known[rows]
        below = [r for r in known if r < rows]
        above = [r for r in known if r > rows]
        if below and above:
            lo, hi = max(below), min(above)
            return known[lo] + (known[hi] - known[lo]) * (rows - lo) / (hi - lo)
        if above:  # below every measured count: no cheaper than the smallest
            return known[min(above)]
        top = sorted(known)[-2:]
        if len(top) < 2:
            return known[top[0]]
        slope = max(0.0, (known[top[1]] - known[top[0]]) / (top[1] - top[0]))
        return known[top[1]] + slope * (rows - top[1])

    # -- the decision ----------------------------------------------------------------------------
    def plan(self, rows: int, proposals: list[tuple[str, int]]) -> dict[str, int]:
        """rows: the step's rows before any draft; proposals: (request id, drafts it has). Returns
        request id -> drafts to check (absent: none)."""
        self._steps += 1
        if not self.adaptive:
            return {rid: min(n, self.max_drafts) for rid, n in proposals if n > 0}
        explored = None
        if self._steps % EXPLORE_EVERY == 0 and proposals:
            explored = proposals[(self._steps // EXPLORE_EVERY) % len(proposals)][0]
        shares = {rid: self.kept_share(rid) for rid, _ in proposals}
        known = self._monotone()
        out: dict[str, int] = {}
        expected = float(rows)  # every row before the drafts yields its token
        now = self.step_time(rows, known)  # t(rows), carried as rows grow
        for rid, n in sorted(proposals, key=lambda p: -shares[p[0]]):
            a = shares[rid]
            for j in range(1, min(n, self.max_drafts) + 1):
                more = self.step_time(rows + 1, known)
                gain = a ** j
                pays = now is None or more is None or gain * now >= expected * (more - now)
                if not (pays or (rid == explored and j == 1)):
                    break
                out[rid] = j
                rows += 1
                now = more
                expected += gain
        return out


__all__ = ["DraftPolicy"]
