"""Whether a request is disaggregated: the router's rule, pure (no I/O, no clocks).

With both pools up, a request is prefilled on a prefill worker and decoded on a decode worker,
unless a decode worker should compute its prompt itself:

    short     its uncached part is at most `min_uncached_tokens` (conditional disaggregation: a
              short prompt costs the decode worker about what the hand-off would);
    backlog   the least busy prefill worker already has more than `max_prefill_backlog_tokens`
              prompt tokens sent to it and not yet prefilled, and a decode worker would be done
              with its own backlog and this prompt before the prefill worker could even start it;
              with `max_decode_inflight` set, only a decode worker with at most that many requests
              in flight counts.

Why the backlog rule: one prefill worker serves every prompt that two aggregated instances on the
same cores would split, so at the same request rate it runs at twice their prefill load and its
queue sets TTFT (measured on the pinned sweep, benchmarks/RESULTS.md sessions 26-27). Sending a
prompt to the decode worker only while the prefill worker is behind keeps the decode pool's steps
free of prefills whenever the prefill pool keeps up, which is what disaggregation is for. And
only a prompt shorter than the queue it would wait behind: each prompt a decode worker computes
stalls every decode running there for as long as it takes (a whole-prompt step, or chunks adding
up to the same), so the decode worker takes the short prompts, whose TTFT the queue would
multiply, and the long ones keep to the prefill pool (measured: with the plain "decode worker
less behind" test, TPOT p99 at 0.5 req/s went to 1.75x aggregated).

Why `max_decode_inflight`: the cost of a prompt computed on a decode worker is one long gap for
each request decoding there, so ITL p99 pays for it in proportion to how many there are. A decode
worker with none or one in flight (0 or 1) can take a prompt for almost nothing in the tail,
which keeps the backlog rule's TTFT gain without the ITL p99 it cost at 1 req/s (RESULTS.md,
session 31).

The rule only says that a decode worker prefills; which one is the routing policy's pick among
the decode pool (least loaded unless a cached prefix says otherwise), so with several decode
workers the one it counted is usually, not always, the one that gets the prompt.

Backlogs are the router's own counts (`WorkerHandle.prefill_backlog`, kept by LegRunner): the
prompt tokens of its legs that compute a prompt on that worker, from the call until the leg's
first response. A decode leg that loads its KV counts nothing. In-flight counts are too
(`WorkerHandle.num_inflight`: requests this router has on the worker and has not seen finish).
Other routers' requests are not seen: with several routers each one balances its own share.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

REMOTE = "disaggregated"
SHORT = "short"
BACKLOG = "backlog"
LOCAL_REASONS = (SHORT, BACKLOG)


@dataclass(frozen=True)
class DisaggRule:
    min_uncached_tokens: int = 0         # 0: any prompt may be disaggregated
    max_prefill_backlog_tokens: int = 0  # 0: no limit (a prefill worker's queue never sends work back)
    max_decode_inflight: int | None = None  # the backlog rule only for a decode worker this idle; None: any

    def __post_init__(self) -> None:
        for name in ("min_uncached_tokens", "max_prefill_backlog_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_decode_inflight is not None:
            if self.max_decode_inflight < 0:
                raise ValueError(f"max_decode_inflight must be >= 0, got {self.max_decode_inflight}")
            if self.max_prefill_backlog_tokens == 0:
                raise ValueError("max_decode_inflight limits the backlog rule: it needs max_prefill_backlog_tokens > 0")

    def choose(self, uncached_tokens: int, prefill_backlogs: Iterable[int], decode_backlogs: Iterable[int],
               decode_inflight: Iterable[int] = ()) -> str:
        """REMOTE, or the reason a decode worker prefills the request itself (SHORT, BACKLOG).
        The backlogs (and in-flight counts) are those of the healthy workers of each pool (both
        non-empty; decode_inflight is only read with max_decode_inflight set)."""
        if self.min_uncached_tokens > 0 and uncached_tokens <= self.min_uncached_tokens:
            return SHORT
        if self.max_prefill_backlog_tokens > 0:
            prefill = min(prefill_backlogs)
            backlogs = list(decode_backlogs)
            if self.max_decode_inflight is not None:  # only decode workers this idle may take it
                backlogs = [b for b, n in zip(backlogs, decode_inflight, strict=True) if n <= self.max_decode_inflight]
            if prefill > self.max_prefill_backlog_tokens and backlogs and min(backlogs) + uncached_tokens < prefill:
                return BACKLOG
        return REMOTE
