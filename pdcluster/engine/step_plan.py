"""What one Scheduler.schedule() call decides: the step being built and the admission outcomes."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pdcluster.engine.outputs import CachedRequestData, NewRequestData
from pdcluster.engine.request import Request


class AdmitOutcome(enum.Enum):
    """Outcome of trying to admit one waiting request."""

    ADMITTED = enum.auto()  # runs from this step
    REMOTE = enum.auto()  # waits for a connector's asynchronous load
    SKIP = enum.auto()  # the connector cannot tell yet: try the requests behind it
    BLOCKED = enum.auto()  # no budget or blocks: stop admitting this step
    DROPPED = enum.auto()  # failed (it can never fit): its error goes out with update()


@dataclass
class StepPlan:
    """What one schedule() call has decided so far."""

    budget: int
    num_scheduled: dict[str, int] = field(default_factory=dict)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    scheduled: list[Request] = field(default_factory=list)
    preempted: bool = False
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)  # drafts, in num_scheduled
    loads: list[str] = field(default_factory=list)  # requests whose connector load starts this step
    # Decodes with n-gram drafts found: (request, drafts, its CachedRequestData), for _add_drafts.
    proposals: list[tuple[Request, list[int], CachedRequestData]] = field(default_factory=list)

    def add(self, request: Request, num_tokens: int) -> None:
        """Schedule num_tokens for request (again: the new count replaces the old one)."""
        old = self.num_scheduled.get(request.request_id)
        if old is None:
            self.scheduled.append(request)
        self.num_scheduled[request.request_id] = num_tokens
        self.budget -= num_tokens - (old or 0)


__all__ = ["AdmitOutcome", "StepPlan"]
