"""Stored Responses (OpenAI's `store`): what `previous_response_id` continues and
`GET /v1/responses/{id}` returns.

Kept in the router's memory, bounded by bytes (RouterConfig.responses_store_bytes; 0 = none, and
then `store: true` and `previous_response_id` are refused by name): the least recently used
response goes first, and one larger than a quarter of the budget is not kept at all (its answer
says "store": false). Each entry holds the Response object and the conversation that led to it as
Responses input items (earlier turns, this request's input, this answer's output), so a
continuation is that conversation plus the new input. A restart forgets everything; ids are 128
random bits, never client-chosen, so one client cannot read or replace another's by guessing.
"""

from __future__ import annotations

import json
import secrets
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_RESPONSES_STORE_BYTES = 64 << 20
_ENTRY_OVERHEAD = 512


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    conversation: tuple[dict[str, Any], ...]  # Responses input items, oldest first
    nbytes: int


def new_response_id() -> str:
    return "resp_" + secrets.token_hex(16)


def output_as_input(output: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """An answer's output items as the input items a continuation sends back: its thought (for
    the assistant turn after it), its message text and its function calls."""
    items: list[dict[str, Any]] = []
    for item in output:
        if item.get("type") == "reasoning" and item.get("content"):
            items.append({"type": "reasoning", "content": [dict(p) for p in item["content"]]})
        elif item.get("type") == "message":
            texts = [p for p in item.get("content", []) if p.get("type") == "output_text" and p.get("text")]
            if texts:
                items.append({"type": "message", "role": "assistant",
                              "content": [{"type": "output_text", "text": p["text"]} for p in texts]})
        elif item.get("type") == "function_call":
            items.append({"type": "function_call", "call_id": item["call_id"], "name": item["name"],
                          "arguments": item["arguments"]})
    # A thought goes back only with the turn it led to (an answer of nothing but a thought has none).
    return [it for k, it in enumerate(items)
            if it["type"] != "reasoning" or (k + 1 < len(items) and items[k + 1]["type"] != "reasoning")]


class ResponseStore:
    def __init__(self, max_bytes: int = DEFAULT_RESPONSES_STORE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict[str, Any], conversation: Sequence[dict[str, Any]]) -> bool:
        """Keep it (False: too large for the budget, or the store is off)."""
        size = len(json.dumps(response)) + len(json.dumps(list(conversation))) + _ENTRY_OVERHEAD
        if not self.enabled or size * 4 > self.max_bytes:
            return False
        old = self._entries.pop(response["id"], None)
        if old is not None:
            self._bytes -= old.nbytes
        while self._entries and self._bytes + size > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.nbytes
        self._entries[response["id"]] = StoredResponse(response, tuple(conversation), size)
        self._bytes += size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._bytes -= entry.nbytes
        return True
