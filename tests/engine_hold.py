"""A test hook on a real engine: hold requests after their first outputs.

Tests of cancellation, deadlines, Abort and shutdown need a request that is still running when
the end arrives. A long max_tokens only makes that likely on a slow machine; a held request can
only end from outside (cancel, deadline, abort, shutdown), however fast the machine is.

    with EngineHold(engine, "r1"):   # an in-process AsyncEngine: r1, after its first output
        ...
    python tests/held_cli.py serve-worker ...   # a worker process: ids starting with HOLD_PREFIX,
                                                # after their first HOLD_AFTER outputs

The hold replaces LLMEngine.step on the engine thread: while every unfinished request is a held
one that has had its outputs, a step is skipped (no tokens, no state change); commands (add,
abort, call) are still applied between skipped steps. A step runs as soon as any other request
is unfinished (the held ones advance with it, by as many steps as the other needs) or a held
request has ended. EngineHold holds each id once (a later request reusing it runs normally);
held_cli holds every request with a matching id (tests share its worker processes)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

HOLD_PREFIX = "held-"  # held_cli holds the requests whose id starts with this,
HOLD_AFTER = 3  # after their first 3 outputs (tests read up to 3 deltas before ending one)
_SKIP_S = 0.005  # a skipped step waits this long, so the engine loop does not spin


class _Holds:
    """The held requests of one LLMEngine (touched only on its engine thread)."""

    def __init__(self, wanted: Callable[[str], bool], once: bool, after: int) -> None:
        self._wanted = wanted
        self._once = once
        self._after = after
        self._seen: set[str] = set()  # ids held so far (once: not again)
        self._outputs: dict[str, tuple[Any, int]] = {}  # id -> (engine Request, outputs so far)
        self._held: list[Any] = []  # the unfinished held requests' engine Request objects

    def step(self, llm: Any, real_step: Callable[[], list]) -> list:
        requests = llm.core.scheduler.requests
        self._held = [r for r in self._held if requests.get(r.request_id) is r]
        if self._held and len(self._held) == len(requests):
            time.sleep(_SKIP_S)
            return []
        outputs = real_step()
        for out in outputs:
            req = requests.get(out.request_id)
            if req is None or not self._wanted(req.request_id) or any(r is req for r in self._held):
                continue
            if self._once and req.request_id in self._seen:
                continue
            seen_req, n = self._outputs.get(req.request_id, (req, 0))
            n = n + 1 if seen_req is req else 1
            self._outputs[req.request_id] = (req, n)
            if n >= self._after:
                del self._outputs[req.request_id]
                self._seen.add(req.request_id)
                self._held.append(req)
        return outputs


class EngineHold:
    """Hold these requests of an in-process AsyncEngine while the block runs."""

    def __init__(self, engine: Any, *request_ids: str, after: int = 1) -> None:
        """engine: an AsyncEngine; request_ids: the requests to hold after their first `after` outputs."""
        ids = frozenset(request_ids)
        self._llm = engine.engine
        self._holds = _Holds(ids.__contains__, once=True, after=after)

    def __enter__(self) -> EngineHold:
        real_step = self._llm.step
        self._llm.step = lambda: self._holds.step(self._llm, real_step)  # shadows the method
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        """Step normally again (idempotent)."""
        self._llm.__dict__.pop("step", None)


def install_prefix_hold(prefix: str = HOLD_PREFIX, after: int = HOLD_AFTER) -> None:
    """In this process, every LLMEngine holds the requests whose id starts with prefix, after
    their first `after` outputs."""
    from pdcluster.engine.llm_engine import LLMEngine

    real_step = LLMEngine.step

    def step(self: Any) -> list:
        holds = self.__dict__.get("_test_holds")
        if holds is None:
            holds = self.__dict__["_test_holds"] = _Holds(lambda rid: rid.startswith(prefix), once=False, after=after)
        return holds.step(self, lambda: real_step(self))

    LLMEngine.step = step  # type: ignore[method-assign]
