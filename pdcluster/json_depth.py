"""Nesting depth of parsed JSON, counted without recursion (the parser recurses; this must not).
Used wherever a client's JSON reaches code whose cost grows with depth: the router's bodies and
JSON string fields (router/json_text.py), structured-output schemas (structured_spec.py)."""

from __future__ import annotations

from typing import Any


def depth(obj: Any, limit: int) -> int:
    """Levels of dicts and lists in obj (a scalar is 0); stops counting once past limit."""
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
