"""Stored Responses (OpenAI's `store`): what `previous_response_id` continues, what
`GET /v1/responses/{id}` returns and what `GET /v1/responses/{id}/input_items` lists.

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import invalid

DEFAULT_RESPONSES_STORE_BYTES = 64 << 20
_ENTRY_OVERHEAD = 512
_ITEM_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
MAX_LIST_LIMIT = 100  # OpenAI's bound on a list page


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    conversation: tuple[dict[str, Any], ...]  # Responses input items, oldest first
    nbytes: int
    # The ids of the items this answer was generated from: the first len(input_ids) items of
    # conversation (earlier turns, then its request's input; its own output comes after them).
    input_ids: tuple[str, ...] = ()

    def input_items(self) -> list[dict[str, Any]]:
        """The items this answer was generated from, oldest first, as OpenAI lists them: each
        with its id and a type, a message's content as a list of parts."""
        return [_listed(item, item_id) for item, item_id in zip(self.conversation, self.input_ids)]


def _item_id(item: dict[str, Any]) -> str:
    given = item.get("id")
    if isinstance(given, str) and given:
        return given
    return f"{_ITEM_ID_PREFIX.get(item.get('type', 'message'), 'item')}_{secrets.token_hex(16)}"


def _listed(item: dict[str, Any], item_id: str) -> dict[str, Any]:
    out = {"id": item_id, **{k: v for k, v in item.items() if k != "id"}}
    if out.setdefault("type", "message") == "message":  # a bare {"role", "content"} is a message
        if isinstance(out.get("content"), str):
            part = "output_text" if out.get("role") == "assistant" else "input_text"
            out["content"] = [{"type": part, "text": out["content"]}]
        out.setdefault("status", "completed")
    return out


def list_page(items: Sequence[dict[str, Any]], query: Mapping[str, str]) -> dict[str, Any]:
    """One page of an OpenAI list ({"object": "list", "data", "first_id", "last_id", "has_more"})
    of items that carry ids, from the query's limit (1-100, default 20), order ("asc" or "desc",
    the default: newest first) and after (the id the previous page ended with). Any other
    parameter, `include` among them, is refused by name."""
    for name in query:
        if name not in ("limit", "order", "after"):
            raise invalid(name, "is not served by this list (its parameters: limit, order, after)")
    raw_limit = query.get("limit", "20")
    if not (raw_limit.isascii() and raw_limit.isdigit()) or not 1 <= int(raw_limit) <= MAX_LIST_LIMIT:
        raise invalid("limit", f"must be an integer from 1 to {MAX_LIST_LIMIT}, got {raw_limit[:40]!r}")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid("order", f"must be 'asc' or 'desc', got {order[:40]!r}")
    ordered = list(items) if order == "asc" else list(reversed(items))
    start = 0
    after = query.get("after")
    if after is not None:
        start = next((k + 1 for k, item in enumerate(ordered) if item["id"] == after), -1)
        if start < 0:
            raise invalid("after", f"no item of this list has id {after[:80]!r}")
    end = start + int(raw_limit)
    page = ordered[start:end]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": end < len(ordered)}


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

    def put(self, response: dict[str, Any], conversation: Sequence[dict[str, Any]], num_input: int = 0) -> bool:
        """Keep it (False: too large for the budget, or the store is off). num_input: how many
        of conversation's first items the answer was generated from (its input items)."""
        size = len(json.dumps(response)) + len(json.dumps(list(conversation))) + _ENTRY_OVERHEAD
        if not self.enabled or size * 4 > self.max_bytes:
            return False
        old = self._entries.pop(response["id"], None)
        if old is not None:
            self._bytes -= old.nbytes
        while self._entries and self._bytes + size > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.nbytes
        input_ids = tuple(_item_id(item) for item in conversation[:num_input])
        self._entries[response["id"]] = StoredResponse(response, tuple(conversation), size, input_ids)
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
