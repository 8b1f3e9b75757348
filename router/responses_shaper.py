"""The Responses API's answers (router/responses_api.py parses the requests): a Response object,
or its typed SSE events, built from a chat request's worker deltas. The chat ResponseBuilder
keeps the usage counts, formats logprobs, reads tool calls out of the text and splits a thought
off it (--reasoning-parser)."""

from __future__ import annotations

import secrets
import time
from typing import Any

from pdcluster._proto import common_pb2, worker_pb2

from .openai_protocol import OpenAIOptions
from .openai_responses import ResponseBuilder, TokenDecoder
from .openai_tools import extract_tool_calls
from .response_store import new_response_id
from .responses_api import ResponsesRequest

_STATUS = {common_pb2.FINISH_REASON_STOP: "completed", common_pb2.FINISH_REASON_LENGTH: "incomplete",
           common_pb2.FINISH_REASON_ABORT: "cancelled", common_pb2.FINISH_REASON_ERROR: "failed"}


class ResponseShaper:
    """One request's Response object and stream events. The chat ResponseBuilder keeps the usage
    counts, formats logprobs and reads tool calls out of the text."""

    def __init__(self, request_id: str, opts: OpenAIOptions, info: ResponsesRequest, num_prompt_tokens: int,
                 decode_token: TokenDecoder) -> None:
        self.opts = opts
        self.info = info
        self.builder = ResponseBuilder(request_id, opts, num_prompt_tokens, decode_token)
        # 128 random bits, never the client's X-Request-Id: a stored response is fetched by its id.
        self.id = new_response_id()
        self.message_id = "msg_" + request_id
        self.reasoning_id = "rs_" + request_id
        # Tools and reasoning both need the whole text to tell its parts apart: held to the end.
        self.held = opts.tools is not None or opts.reasoning is not None
        self.created_at = int(time.time())
        self.sequence_number = 0
        self.text: list[str] = []
        self.logprobs: list[dict[str, Any]] = []

    # -- the Response object ----------------------------------------------------------------------
    def response(self, status: str, output: list[dict[str, Any]], *, error: str | None = None,
                 usage: bool = True) -> dict[str, Any]:
        info = self.info
        b = self.builder
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "error": {"code": "server_error", "message": error} if error is not None else None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": info.instructions, "max_output_tokens": info.max_output_tokens,
            "model": self.opts.model, "output": output, "parallel_tool_calls": info.parallel_tool_calls,
            "previous_response_id": info.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "store": info.store,
            "temperature": info.temperature, "text": {"format": info.text_format}, "tool_choice": info.tool_choice,
            "tools": info.tools, "top_logprobs": info.top_logprobs, "top_p": info.top_p, "truncation": "disabled",
            "user": info.user, "metadata": info.metadata,
            "usage": {"input_tokens": b.num_prompt_tokens,
                      "input_tokens_details": {"cached_tokens": b.num_cached_tokens},
                      "output_tokens": b.num_completion_tokens,
                      "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": b.num_prompt_tokens + b.num_completion_tokens} if usage else None,
        }

    def add(self, delta: worker_pb2.WorkerGenerateResponse) -> list[dict[str, Any]]:
        """Account one delta; its logprob entries in the Responses shape."""
        self.builder.account(delta)
        self.text.append(delta.text)
        entries = self.builder.logprobs(delta.logprobs) if self.opts.logprobs is not None else None
        new = list(entries["content"]) if entries else []
        self.logprobs.extend(new)
        return new

    def output(self, status: str) -> list[dict[str, Any]]:
        """The finished output items: the thought (with --reasoning-parser), the message (if it
        has text) and the function calls."""
        reasoning, text = self.builder.split_reasoning("".join(self.text))
        items: list[dict[str, Any]] = []
        if reasoning is not None:
            items.append(self.reasoning_item(reasoning))
        calls: list[dict[str, Any]] = []
        if self.opts.tools is not None:
            content, calls = extract_tool_calls(text, self.opts.tools)
            text = content or ""
        item_status = "incomplete" if status == "incomplete" else "completed"
        if text or not calls:
            items.append(self.message(item_status, text))
        items.extend(function_call_item(c, item_status) for c in calls)
        return items

    def reasoning_item(self, text: str) -> dict[str, Any]:
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [],
                "content": [{"type": "reasoning_text", "text": text}]}

    def message(self, status: str, text: str | None = None) -> dict[str, Any]:
        content = [] if text is None else [self.text_part(text)]
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    def text_part(self, text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [],
                "logprobs": self.logprobs if self.opts.logprobs is not None else []}

    def full(self, finish: int, error: str | None = None) -> dict[str, Any]:
        status = _STATUS.get(finish, "completed")
        return self.response(status, [] if status == "failed" else self.output(status), error=error)

    # -- stream events ----------------------------------------------------------------------------
    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return ev

    def opening(self) -> list[dict[str, Any]]:
        events = [self.event("response.created", response=self.response("in_progress", [], usage=False)),
                  self.event("response.in_progress", response=self.response("in_progress", [], usage=False))]
        if not self.held:
            events += self._message_opening(0)
        return events

    def _message_opening(self, index: int) -> list[dict[str, Any]]:
        return [self.event("response.output_item.added", output_index=index, item=self.message("in_progress")),
                self.event("response.content_part.added", item_id=self.message_id, output_index=index,
                           content_index=0, part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]

    def text_delta(self, text: str, logprobs: list[dict[str, Any]], index: int = 0) -> dict[str, Any]:
        return self.event("response.output_text.delta", item_id=self.message_id, output_index=index, content_index=0,
                          delta=text, logprobs=logprobs)

    def closing(self, finish: int, error: str | None = None) -> list[dict[str, Any]]:
        status = _STATUS.get(finish, "completed")
        if status == "failed":
            return [self.event("response.failed", response=self.response("failed", [], error=error))]
        items = self.output(status)
        events: list[dict[str, Any]] = []
        for index, item in enumerate(items):
            if item["type"] == "reasoning":
                text = item["content"][0]["text"]
                events += [
                    self.event("response.output_item.added", output_index=index,
                               item={**item, "content": []}),
                    self.event("response.reasoning_text.delta", item_id=item["id"], output_index=index,
                               content_index=0, delta=text),
                    self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                               content_index=0, text=text)]
            elif item["type"] == "message":
                part = item["content"][0]
                if self.held:
                    events += self._message_opening(index)
                    events.append(self.text_delta(part["text"], self.logprobs, index))
                events += [
                    self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                               text=part["text"], logprobs=part["logprobs"]),
                    self.event("response.content_part.done", item_id=item["id"], output_index=index,
                               content_index=0, part=part)]
            else:
                events += [
                    self.event("response.output_item.added", output_index=index, item={**item, "arguments": "",
                                                                                         "status": "in_progress"}),
                    self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                               delta=item["arguments"]),
                    self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                               arguments=item["arguments"])]
            events.append(self.event("response.output_item.done", output_index=index, item=item))
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        events.append(self.event(kind, response=self.response(status, items)))
        return events


def function_call_item(call: dict[str, Any], status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": "fc_" + secrets.token_hex(12), "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}


__all__ = ["ResponseShaper", "function_call_item"]
