"""A test hook for faults mid-request: hold a request when its output reaches a mark.

Migration tests kill the worker serving a request after the client has read some of its tokens.
A long max_tokens only makes "still running" likely on a slow machine; here a request whose id
starts with PREFIX stops after the first mark (an output length, from MARKS) beyond the output it
arrived with, until something else ends it: the kill. A request resumed elsewhere arrives with its
output so far (prefill_output_token_ids), so the next worker holds it at the next mark, and past
the last mark it runs to its end. The hold is engine_hold's: while every unfinished request is
held, a step is skipped; any other request makes the held ones advance with it.

    PDCLUSTER_TEST_HOLD_MARKS=4,8 python tests/chaos/mark_hold_cli.py serve-worker ...
"""

from __future__ import annotations

import os
import time
from typing import Any

PREFIX = "mig-"
MARKS_ENV = "PDCLUSTER_TEST_HOLD_MARKS"
_SKIP_S = 0.005  # a skipped step waits this long, so the engine loop does not spin


class _MarkHolds:
    """The held requests of one LLMEngine (touched only on its engine thread)."""

    def __init__(self, marks: tuple[int, ...]) -> None:
        self.marks = marks
        self.mark: dict[str, tuple[Any, int]] = {}  # id -> (engine Request, the output length it stops at)
        self.held: dict[str, Any] = {}

    def step(self, llm: Any, real_step: Any) -> list:
        requests = llm.core.scheduler.requests
        # Forget requests that left the engine (ended, aborted, or an id reused by a new one).
        self.mark = {k: v for k, v in self.mark.items() if requests.get(k) is v[0]}
        self.held = {k: r for k, r in self.held.items() if requests.get(k) is r}
        if self.held and len(self.held) == len(requests):
            if not llm.core.is_healthy():  # e.g. a TP rank died: the step fails, as a running request's would
                return real_step()
            time.sleep(_SKIP_S)
            return []
        outputs = real_step()
        for out in outputs:
            req = requests.get(out.request_id)
            if req is None or not out.request_id.startswith(PREFIX) or out.request_id in self.held:
                continue
            n = len(req.output_token_ids)
            entry = self.mark.get(out.request_id)
            if entry is None or entry[0] is not req:
                start = n - len(out.outputs[0].token_ids) if out.outputs else n - 1
                later = [m for m in self.marks if m > start]
                entry = self.mark[out.request_id] = (req, later[0] if later else 0)
            if entry[1] and n >= entry[1]:
                self.held[out.request_id] = req
        return outputs


def install_mark_hold(marks: tuple[int, ...]) -> None:
    from pdcluster.engine.llm_engine import LLMEngine

    real_step = LLMEngine.step

    def step(self: Any) -> list:
        holds = self.__dict__.get("_test_mark_holds")
        if holds is None:
            holds = self.__dict__["_test_mark_holds"] = _MarkHolds(marks)
        return holds.step(self, lambda: real_step(self))

    LLMEngine.step = step  # type: ignore[method-assign]


def marks_from_env() -> tuple[int, ...]:
    return tuple(sorted(int(m) for m in os.environ.get(MARKS_ENV, "").split(",") if m.strip()))
