"""Tool calls read out of a finished answer under tool_choice "auto" (vLLM's --tool-call-parser).

Each model family writes calls its own way; a parser turns the answer's text into (content, calls)
where calls are (function name, arguments object or JSON text) of functions the request offered.
Text that is not a call of the format stays content; a call to a function not offered is dropped.

    hermes       <tool_call>{"name": "f", "arguments": {...}}</tool_call> blocks (Qwen, Hermes)
    llama3_json  {"name": "f", "parameters": {...}}, several joined by ";" (Llama 3.x;
                 an optional leading <|python_tag|>)
    mistral      [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...] (the marker is a special
                 token, so a skip_special_tokens answer is read from its JSON list alone)
    pythonic     [f(a=1, b="x"), g()] (Llama 3.2 / 4; <|python_start|>...<|python_end|> allowed):
                 read with ast, values as literals only (never evaluated)

An operator can name another parser as "package.module:function" (the Registry's dotted path) or
install one under the entry-point group `pdcluster.tool_parsers`: a callable
`(text, names) -> (content, [(name, arguments), ...])`.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from pdcluster.registry import Registry

Calls = list[tuple[str, Any]]
ToolCallParser = Callable[[str, Sequence[str]], tuple[str | None, Calls]]

_HERMES = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)
_DECODER = json.JSONDecoder()


def loads(text: str) -> Any:
    """Parsed JSON, or None when it is none. Nesting deeper than the parser's stack is none too:
    a model's output may be "[[[[..."."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _call(obj: Any, names: Sequence[str]) -> tuple[str, Any] | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    return obj["name"], obj.get("arguments", obj.get("parameters", {}))


def hermes(text: str, names: Sequence[str]) -> tuple[str | None, Calls]:
    calls = [c for m in _HERMES.finditer(text) if (c := _call(loads(m.group(1)), names)) is not None]
    if not calls:
        return text, []
    return text[: text.find("<tool_call>")].strip() or None, calls


def llama3_json(text: str, names: Sequence[str]) -> tuple[str | None, Calls]:
    body = text.strip().removeprefix("<|python_tag|>").lstrip()
    calls: Calls = []
    pos = 0
    while pos < len(body) and body[pos] == "{":
        try:
            obj, end = _DECODER.raw_decode(body, pos)
        except (ValueError, RecursionError):
            break
        call = _call(obj, names)
        if call is None:
            break
        calls.append(call)
        pos = end
        while pos < len(body) and (body[pos].isspace() or body[pos] == ";"):
            pos += 1
    if not calls:
        return text, []
    return body[pos:].strip() or None, calls


def mistral(text: str, names: Sequence[str]) -> tuple[str | None, Calls]:
    content, marker, rest = text.partition("[TOOL_CALLS]")
    if not marker:  # the marker was a special token the detokenizer skipped: the list alone
        content, rest = "", text
    try:
        listed, end = _DECODER.raw_decode(rest.lstrip())
    except (ValueError, RecursionError):
        return text, []
    listed = listed if isinstance(listed, list) else [listed]
    calls = [c for obj in listed if (c := _call(obj, names)) is not None]
    if not calls:
        return text, []
    return content.strip() or None, calls


def pythonic(text: str, names: Sequence[str]) -> tuple[str | None, Calls]:
    body = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
    if not (body.startswith("[") and body.endswith("]")):
        return text, []
    try:
        tree = ast.parse(body, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return text, []
    if not isinstance(tree.body, ast.List):
        return text, []
    calls: Calls = []
    for node in tree.body.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
                and node.func.id in names and all(k.arg is not None for k in node.keywords)):
            return text, []  # not a list of keyword-argument calls of offered functions: plain text
        try:  # literals only; and only what JSON can carry (no bytes, sets, complex, inf)
            args = json.dumps({k.arg: ast.literal_eval(k.value) for k in node.keywords}, allow_nan=False)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return text, []
        calls.append((node.func.id, args))
    return (None, calls) if calls else (text, [])


def _check(obj: object) -> ToolCallParser:
    if not callable(obj):
        raise ValueError("a tool call parser must be a callable (text, names) -> (content, calls)")
    return obj  # type: ignore[return-value]


TOOL_CALL_PARSERS: Registry[ToolCallParser] = Registry("tool call parser", check=_check,
                                                       entry_point_group="pdcluster.tool_parsers")
for _name, _fn in (("hermes", hermes), ("llama3_json", llama3_json), ("mistral", mistral), ("pythonic", pythonic)):
    TOOL_CALL_PARSERS.register(_name, _fn)
