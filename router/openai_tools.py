"""Tool calling in chat: `tools`, `tool_choice`, and the tool calls in the answer.

    tools           [{"type": "function", "function": {"name", "description", "parameters"}}],
                    given to the chat template (ChatMessages.tools_json) unless tool_choice is "none"
    tool_choice     "none" | "auto" (default with tools) | "required" | {"type": "function",
                    "function": {"name": ...}}
    answer          auto: the calls the server's --tool-call-parser reads out of the text
                    (tool_parsers.py; hermes by default); required: the output is forced by the grammar
                    engine to a JSON list of {"name", "parameters"} of the tools (vLLM's way);
                    named: forced to the JSON of that function's parameters. Either way the
                    arguments validate against the function's schema.

Streams: a named function's arguments are the output itself, streamed as fragments of one call
(openai_responses.py); with auto/required the text is held back and the tool calls (or the text,
if there were none) go in the final chunk: a call is only known once it is complete.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from pdcluster._proto import common_pb2

from .errors import invalid
from .tool_parsers import TOOL_CALL_PARSERS
from .tool_parsers import loads as _loads

MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True)
class ToolMode:
    choice: str  # "auto" | "required" | "named"
    names: tuple[str, ...]
    name: str | None = None  # the forced function (named)
    parser: str = "hermes"  # auto: the server's --tool-call-parser (tool_parsers.py)


def parse_tools(body: dict, chat: Any, sp: common_pb2.SamplingParams, structured: str | None) -> ToolMode | None:
    """Validate tools/tool_choice, render the tools into the chat request and force the grammar
    for required/named. Returns how the answer is to be read, or None when no tool is in play."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools in (None, []):
        if choice not in (None, "none"):
            raise invalid("tool_choice", "needs tools")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise invalid("tools", f"must be a list of at most {MAX_TOOLS} tools")
    functions: dict[str, dict] = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise invalid("tools", f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise invalid("tools", f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-'")
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise invalid("tools", f"tools[{i}].function.parameters must be a JSON schema object")
        if name in functions:  # a later definition would silently replace the earlier one
            raise invalid("tools", f"tools[{i}].function.name {name!r} is given twice")
        functions[name] = params
    choice = "auto" if choice is None else choice
    if choice == "none":
        return None
    chat.tools_json = json.dumps(tools, ensure_ascii=False)
    if choice == "auto":
        return ToolMode("auto", tuple(functions))
    if structured is not None:
        raise invalid("tool_choice", f"a forced tool call cannot be combined with {structured}")
    if choice == "required":
        items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [n]}, "parameters": p},
                  "required": ["name", "parameters"]} for n, p in functions.items()]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if body.get("parallel_tool_calls") is False:
            schema["maxItems"] = 1
        sp.structured_outputs.json = json.dumps(schema, sort_keys=True, separators=(",", ":"))
        return ToolMode("required", tuple(functions))
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if name not in functions:
        raise invalid("tool_choice", "must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                      f"{{'name': one of {sorted(functions)}}}}}")
    sp.structured_outputs.json = json.dumps(functions[name], sort_keys=True, separators=(",", ":"))
    return ToolMode("named", tuple(functions), name)


def extract_tool_calls(text: str, mode: ToolMode) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a finished answer."""
    calls: list[tuple[str, Any]] = []
    content: str | None = text
    if mode.choice == "named":
        calls, content = [(mode.name or "", text)], None  # the forced JSON, as generated
    elif mode.choice == "required":
        parsed = _loads(text)
        if isinstance(parsed, list):
            calls = [(c.get("name", ""), c.get("parameters")) for c in parsed if isinstance(c, dict)]
            content = None
    else:
        content, calls = TOOL_CALL_PARSERS.get(mode.parser)(text, mode.names)
    out = [{"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}}
           for name, args in calls]
    return content, out


def chat_message_tool_fields(m: dict, i: int, msg: Any) -> None:
    """An input message's tool fields (assistant tool_calls, tool_call_id) into the proto."""
    calls = m.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list) or len(calls) > MAX_TOOLS:
            raise invalid("messages", f"messages[{i}].tool_calls must be a list of at most {MAX_TOOLS} calls")
        if calls:
            msg.tool_calls_json = json.dumps([_call_for_template(c, i) for c in calls], ensure_ascii=False)
    call_id = m.get("tool_call_id")
    if call_id is not None:
        if not isinstance(call_id, str):
            raise invalid("messages", f"messages[{i}].tool_call_id must be a string")
        msg.tool_call_id = call_id


def _call_for_template(call: Any, i: int) -> dict[str, Any]:
    """Templates read function.arguments as an object (transformers' convention)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise invalid("messages", f"messages[{i}].tool_calls: each needs function.name")
    args = fn.get("arguments", {})
    if isinstance(args, str):  # what parses goes on into tool_calls_json, whose depth the Preprocessor bounds
        parsed = _loads(args)
        args = parsed if parsed is not None else args
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}

