"""What a worker tracks per running request, shared by Generate and GenerateStream."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc


class Refusal(Exception):
    """A request ends with this status code instead of (more) deltas."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Inflight:
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    task: asyncio.Task | None = None
    num_tokens: int = 0
    num_prompt_tokens: int = 0
    # GenerateStream: ends the request with finish_reason ABORT (Generate's queue gets request_table.ABORTED instead).
    on_abort: Callable[[], None] | None = None
    # Where an item for the request goes besides the pump's outputs (request_table.MOVED at a
    # drain's end); None: the queue (Generate).
    deliver: Callable[[object], object] | None = None
