"""A test hook on a real engine: hold requests after their first output.

Tests of cancellation, deadlines, Abort and shutdown need a request that is still running when
the end arrives. A long max_tokens only makes that likely on a slow machine; a held request can
only end from outside (cancel, deadline, abort, shutdown), however fast the machine is.

    with EngineHold(engine, "r1"):   # an in-process AsyncEngine
        ...
    python -m held_cli serve-worker ...   # a worker process: ids starting with HOLD_PREFIX

The hold replaces LLMEngine.step on the engine thread: while every unfinished request is a held
one that has produced an output, a step is skipped (no tokens, no state change); commands (add,
abort, call) are still applied between skipped steps. A step runs as soon as any other request
is unfinished (the held ones advance with it, by as many steps as the other needs) or a held
request has ended. Each id is held once: a later request reusing it runs normally."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

HOLD_PREFIX = "held-"  # held_cli holds the requests whose id starts with this
_SKIP_S = 0.005  # a skipped step waits this long, so the engine loop does not spin


class _Holds:
    """The held requests of one LLMEngine (touched only on its engine thread)."""

    def __init__(self, wanted: Callable[[str], bool]) -> None:
        self._wanted = wanted
        self._seen: set[str] = set()  # ids already held once
        self._held: list[Any] = []  # their engine Request objects

    def step(self, llm: Any, real_step: Callable[[], list]) -> list:
        requests = llm.core.scheduler.requests
        live = [r for r in self._held if requests.get(r.request_id) is r]
        if live and len(live) == len(requests):
            time.sleep(_SKIP_S)
            return []
        outputs = real_step()
        for out in outputs:
            rid = out.request_id
            if rid not in self._seen and rid in requests and self._wanted(rid):
                self._seen.add(rid)
                self._held.append(requests[rid])
        return outputs


class EngineHold:
    """Hold these requests of an in-process AsyncEngine while the block runs."""

    def __init__(self, engine: Any, *request_ids: str) -> None:
        ids = frozenset(request_ids)
        self._llm = engine.engine
        self._holds = _Holds(ids.__contains__)

    def __enter__(self) -> EngineHold:
        real_step = self._llm.step
        self._llm.step = lambda: self._holds.step(self._llm, real_step)  # shadows the method
        return self

    def __exit__(self, *exc: object) -> None:
        del self._llm.step


def install_prefix_hold(prefix: str = HOLD_PREFIX) -> None:
    """In this process, every LLMEngine holds the requests whose id starts with prefix."""
    from pdcluster.engine.llm_engine import LLMEngine

    real_step = LLMEngine.step

    def step(self: Any) -> list:
        holds = self.__dict__.get("_test_holds")
        if holds is None:
            holds = self.__dict__["_test_holds"] = _Holds(lambda rid: rid.startswith(prefix))
        return holds.step(self, lambda: real_step(self))

    LLMEngine.step = step  # type: ignore[method-assign]
