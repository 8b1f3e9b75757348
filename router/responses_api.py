"""OpenAI's Responses API (POST /v1/responses) on the router's chat path.

A Responses body is translated into the chat body it means, then parsed by parse_chat like any
chat request (one set of checks, one GenerateRequest shape):

    instructions                   -> a leading system message
    input (a string)               -> one user message
    input items                    -> messages: {role, content} items (content a string or input_text /
                                      output_text / input_image parts; role "developer" is the system's),
                                      function_call -> an assistant message with tool_calls,
                                      function_call_output -> a tool message,
                                      reasoning -> the thought of the assistant turn right after it
    max_output_tokens              -> max_tokens
    text.format                    -> response_format (text / json_object / json_schema)
    tools (flat function tools)    -> chat tools; tool_choice likewise
    include + top_logprobs         -> logprobs on the output text

`store` (OpenAI's default: true) keeps the answer in the router's ResponseStore
(router/response_store.py), and `previous_response_id` continues a stored one: its conversation
comes before this input, after this request's instructions (a previous response's instructions are
not carried over, as in OpenAI's API). With the store off both are refused by name, as are
`background`, `truncation: "auto"`, `reasoning` (effort settings) and non-function tools. The answer (router/responses_shaper.py) is a Response
object, or its typed SSE events (`event:` and `data:` lines, numbered by sequence_number) ending in
response.completed, response.incomplete (the token limit) or response.failed; with the server's
--reasoning-parser a `reasoning` item comes before the message.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdcluster._proto import router_pb2

from .errors import RouterError, invalid
from .openai_images import ImageLimits
from .openai_protocol import (
    _SAMPLING_FIELDS,
    MAX_MESSAGES,
    OpenAIOptions,
    _bool,
    _check_fields,
    _is_int,
    _object,
    parse_chat,
)

# Responses fields this server honours, and vLLM's sampling extras it accepts on every endpoint.
RESPONSES_FIELDS = frozenset({
    "model", "input", "instructions", "max_output_tokens", "stream", "store", "metadata", "text", "tools",
    "tool_choice", "parallel_tool_calls", "user", "truncation", "previous_response_id", "reasoning",
    "background", "include", "top_logprobs", "service_tier",
    "stop", "stop_token_ids", "logit_bias", "allowed_token_ids", "bad_words", *_SAMPLING_FIELDS})
_CHAT_PASSTHROUGH = ("model", "user", "parallel_tool_calls", "stop", "stop_token_ids", "logit_bias",
                     "allowed_token_ids", "bad_words", *_SAMPLING_FIELDS)
LOGPROBS_INCLUDE = "message.output_text.logprobs"
MAX_METADATA = 16          # OpenAI's limits on metadata: 16 pairs, keys <= 64, values <= 512 chars
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
# A chat-side field name -> the Responses field the client sent.
_FIELD_NAMES = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
                "response_format": "text.format", "messages": "input", "logprobs": "top_logprobs"}


@dataclass
class ResponsesRequest:
    """What the Response object echoes back, next to the parsed GenerateRequest."""

    instructions: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    metadata: dict[str, str]
    text_format: dict[str, Any]
    tools: list[dict[str, Any]]
    tool_choice: Any
    parallel_tool_calls: bool
    user: str | None
    top_logprobs: int
    message_of_item: list[int] = field(default_factory=list)  # chat message index -> input item index
    store: bool = False
    previous_response_id: str | None = None
    # The conversation so far as input items: the previous response's, then this request's input.
    conversation: list[dict[str, Any]] = field(default_factory=list)


def parse_responses(body: Any, default_model: str, image_limits: ImageLimits | None = None,
                    store_enabled: bool = False, history: Sequence[dict[str, Any]] = ()
                    ) -> tuple[router_pb2.GenerateRequest, OpenAIOptions, ResponsesRequest]:
    """history: the stored conversation `previous_response_id` names (the caller looked it up)."""
    body = _object(body)
    _check_fields(body, RESPONSES_FIELDS)
    _refuse_unserved(body, store_enabled)
    chat: dict[str, Any] = {k: body[k] for k in _CHAT_PASSTHROUGH if k in body}
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("instructions", "must be a string")
    messages: list[dict[str, Any]] = []
    item_of_message: list[int] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
        item_of_message.append(-1)
    for _, m in _input_messages(list(history)) if history else ():
        messages.append(m)
        item_of_message.append(-2)  # a stored turn: reported as previous_response_id's
    for i, m in _input_messages(body.get("input")):
        messages.append(m)
        item_of_message.append(i)
    chat["messages"] = messages
    limit = body.get("max_output_tokens")
    if limit is not None:
        if not _is_int(limit) or limit < 1:
            raise invalid("max_output_tokens", f"must be an integer >= 1, got {limit!r}")
        chat["max_tokens"] = limit
    text_format = _text_format(body.get("text"))
    if text_format["type"] != "text":
        chat["response_format"] = _chat_response_format(text_format)
    tools = body.get("tools")
    chat_tools = _chat_tools(tools)
    if chat_tools:
        chat["tools"] = chat_tools
    choice = body.get("tool_choice")
    if choice is not None:
        chat["tool_choice"] = _chat_tool_choice(choice)
    top_logprobs = _logprobs(body)
    if top_logprobs is not None:
        chat["logprobs"] = True
        chat["top_logprobs"] = top_logprobs
    chat["stream"] = _bool(body, "stream", False)
    try:
        req, opts = parse_chat(chat, default_model, image_limits)
    except RouterError as e:
        raise rename_error(e, item_of_message) from None
    info = ResponsesRequest(
        instructions=instructions, max_output_tokens=limit, temperature=body.get("temperature"),
        top_p=body.get("top_p"), metadata=_metadata(body.get("metadata")), text_format=text_format,
        tools=list(tools or []), tool_choice=choice if choice is not None else "auto",
        parallel_tool_calls=_bool(body, "parallel_tool_calls", True), user=body.get("user"),
        top_logprobs=top_logprobs or 0, message_of_item=item_of_message,
        store=store_enabled and _bool(body, "store", True), previous_response_id=body.get("previous_response_id"),
        conversation=[*history, *_input_items(body["input"])])
    return req, opts, info


def _input_items(value: Any) -> list[dict[str, Any]]:
    """This request's input as items (a string is one user message), as stored for a continuation."""
    return [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else list(value)


def rename_error(err: RouterError, item_of_message: Sequence[int] = ()) -> RouterError:
    """A refusal the chat path (or the Preprocessor) phrased in chat terms, in the client's terms:
    max_tokens -> max_output_tokens, response_format -> text.format, messages[k] -> input[i]."""
    name = _FIELD_NAMES.get(err.field or "")
    if name is None:
        return err
    message = err.message

    def item(m: re.Match) -> str:
        k = int(m.group(1))
        i = item_of_message[k] if k < len(item_of_message) else k
        return {-1: "instructions", -2: "previous_response_id"}.get(i, f"input[{i}]")

    message = re.sub(r"\bmessages\[(\d+)\]", item, message)
    message = re.sub(rf"\b{re.escape(err.field or '')}\b", name, message)
    return RouterError(err.code, message, name)


def _refuse_unserved(body: dict, store_enabled: bool) -> None:
    if not store_enabled and body.get("store") not in (None, False):
        raise invalid("store", "responses are not stored by this server (--responses-store-bytes 0): send "
                      "store=false or leave it out")
    if not store_enabled and body.get("previous_response_id") is not None:
        raise invalid("previous_response_id", "responses are not stored by this server (--responses-store-bytes 0), "
                      "so none can be continued: send the earlier turns in input")
    if body.get("background") not in (None, False):
        raise invalid("background", "background responses are not supported by this server")
    if body.get("truncation") not in (None, "disabled"):
        raise invalid("truncation", "only 'disabled' is supported: an input longer than the context is refused")
    if body.get("reasoning") not in (None, {}):
        raise invalid("reasoning", "reasoning options are not supported by this server")
    if body.get("service_tier") not in (None, "auto", "default"):
        raise invalid("service_tier", "only 'auto' and 'default' are served")


def _input_messages(value: Any) -> list[tuple[int, dict[str, Any]]]:
    """(input item index, chat message) for every item; function calls in a row form one
    assistant message, as a chat history holds them."""
    if isinstance(value, str):
        return [(0, {"role": "user", "content": value})]
    if not isinstance(value, list) or not value:
        raise invalid("input", "must be a string or a non-empty list of input items")
    if len(value) > MAX_MESSAGES:
        raise invalid("input", f"input has {len(value)} items; at most {MAX_MESSAGES} allowed")
    out: list[tuple[int, dict[str, Any]]] = []
    thought: tuple[int, str] | None = None  # a reasoning item's text, for the assistant turn after it
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise invalid("input", f"input[{i}] must be an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "reasoning":
            thought = (i, _reasoning_text(item, i))
            continue
        if thought is not None and not (kind == "function_call" or (kind == "message" and item.get("role") == "assistant")):
            raise invalid("input", f"input[{thought[0]}]: a reasoning item must come right before the assistant's "
                          "message or function call it led to")
        if kind == "message":
            out.append((i, _message(item, i)))
        elif kind == "function_call":
            call = _function_call(item, i)
            if thought is None and out and out[-1][1].get("role") == "assistant" and out[-1][1].get("tool_calls"):
                out[-1][1]["tool_calls"].append(call)
            else:
                out.append((i, {"role": "assistant", "content": None, "tool_calls": [call]}))
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not isinstance(output, str):
                raise invalid("input", f"input[{i}]: a function_call_output needs string call_id and output")
            out.append((i, {"role": "tool", "tool_call_id": call_id, "content": output}))
        else:
            raise invalid("input", f"input[{i}].type {kind!r} is not supported: message, reasoning, function_call "
                          "and function_call_output items are")
        if thought is not None:  # the thought of the assistant turn just added (its template reads it)
            out[-1][1]["reasoning"] = thought[1]
            thought = None
    if thought is not None:
        raise invalid("input", f"input[{thought[0]}]: a reasoning item must come right before the assistant's "
                      "message or function call it led to")
    return out


def _reasoning_text(item: dict, i: int) -> str:
    """A reasoning item's thought: its reasoning_text content, else its summary_text summary."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not parts or not all(
            isinstance(p, dict) and p.get("type") in ("reasoning_text", "summary_text") and isinstance(p.get("text"), str)
            for p in parts):
        raise invalid("input", f"input[{i}]: a reasoning item needs reasoning_text content or summary_text parts")
    return "".join(p["text"] for p in parts)


def _message(item: dict, i: int) -> dict[str, Any]:
    role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
    if role is None:
        raise invalid("input", f"input[{i}].role must be one of {sorted(_ROLES)}")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise invalid("input", f"input[{i}].content must be a string or a list of content parts")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        elif kind == "input_image":
            raise invalid("input", f"input[{i}].content[{j}]: an input_image needs an image_url (a data: URL); "
                          "file_id is not supported")
        else:
            raise invalid("input", f"input[{i}].content[{j}] must be an input_text, output_text or input_image part")
    return {"role": role, "content": parts}


def _function_call(item: dict, i: int) -> dict[str, Any]:
    call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments")
    if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(args, str):
        raise invalid("input", f"input[{i}]: a function_call needs string call_id, name and arguments")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def _text_format(text: Any) -> dict[str, Any]:
    if text is None:
        return {"type": "text"}
    if not isinstance(text, dict):
        raise invalid("text", "must be an object")
    unknown = sorted(set(text) - {"format", "verbosity"})
    if unknown:
        raise invalid(f"text.{unknown[0]}", "is not supported by this server")
    if text.get("verbosity") not in (None, "medium"):
        raise invalid("text.verbosity", "only 'medium' is served (the model decides its own length)")
    fmt = text.get("format")
    if fmt is None:
        return {"type": "text"}
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise invalid("text.format", "must be {'type': 'text' | 'json_object' | 'json_schema', ...}")
    if fmt["type"] == "json_schema" and not isinstance(fmt.get("schema"), dict):
        raise invalid("text.format", "a json_schema format needs a 'schema' object")
    return fmt


def _chat_response_format(fmt: dict[str, Any]) -> dict[str, Any]:
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": schema}


def _chat_tools(tools: Any) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise invalid("tools", "must be a list of function tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise invalid("tools", f"tools[{i}]: only function tools are served, not {kind!r}")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    if choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise invalid("tool_choice", "must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}")


def _logprobs(body: dict) -> int | None:
    include = body.get("include")
    if include is not None and (not isinstance(include, list) or not all(isinstance(x, str) for x in include)):
        raise invalid("include", "must be a list of strings")
    for x in include or []:
        if x != LOGPROBS_INCLUDE:
            raise invalid("include", f"{x[:80]!r} is not served; only {LOGPROBS_INCLUDE!r} is")
    top = body.get("top_logprobs")
    if top is not None and not _is_int(top):
        raise invalid("top_logprobs", "must be an integer")
    if LOGPROBS_INCLUDE in (include or []):
        return top or 0
    if top:
        raise invalid("top_logprobs", f"needs include=[{LOGPROBS_INCLUDE!r}]")
    return None


def _metadata(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_METADATA:
        raise invalid("metadata", f"must be an object of at most {MAX_METADATA} string pairs")
    for k, v in value.items():
        if len(k) > MAX_METADATA_KEY or not isinstance(v, str) or len(v) > MAX_METADATA_VALUE:
            raise invalid("metadata", f"keys are strings of at most {MAX_METADATA_KEY} characters, values of "
                          f"at most {MAX_METADATA_VALUE}")
    return dict(value)


__all__ = ["RESPONSES_FIELDS", "ResponsesRequest", "parse_responses", "rename_error"]
