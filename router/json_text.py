"""JSON text from clients, parsed with a nesting bound: HTTP bodies, and the JSON a gRPC request
carries in string fields (tools, tool calls, chat template variables).

json.loads recurses per level: a deep enough text raises RecursionError, and a merely deep one
reaches templates and schema compilers that recurse too. So every client JSON goes through
`loads_bounded`, and an excess is INVALID_ARGUMENT naming the field and the limit.
"""

from __future__ import annotations

import json
from typing import Any

from .errors import RouterError, invalid


def loads_bounded(raw: str | bytes, max_depth: int, field: str, what: str) -> Any:
    """Parsed JSON of `raw`, nested at most max_depth levels. `what` names the text in errors
    ("the request body", "tools_json"); `field` is the field the error blames."""
    try:
        value = json.loads(raw)
    except RecursionError:  # deeper than the parser's own stack allows
        raise too_deep(field, what, max_depth) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise invalid(field, f"{what} is not valid JSON: {e}") from None
    # Nothing nests deeper than it has brackets: most texts are cleared by two C-speed counts.
    opens = raw.count("[") + raw.count("{") if isinstance(raw, str) else raw.count(b"[") + raw.count(b"{")
    if opens > max_depth and depth(value, max_depth) > max_depth:
        raise too_deep(field, what, max_depth)
    return value


def too_deep(field: str, what: str, max_depth: int) -> RouterError:
    return invalid(field, f"{what} nests JSON deeper than the limit of {max_depth} levels")


def depth(obj: Any, limit: int) -> int:
    """Nesting depth of parsed JSON (a scalar is 0), iteratively; stops counting once past limit."""
    deepest = 0
    stack = [(obj, 1)] if isinstance(obj, (dict, list)) else []
    while stack:
        node, d = stack.pop()
        if d > deepest:
            deepest = d
            if deepest > limit:
                return deepest
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, d + 1) for c in children if isinstance(c, (dict, list)))
    return deepest
