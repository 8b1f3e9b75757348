"""StructuredOutputs: what a request's output must match (vLLM's StructuredOutputsParams).

Exactly one of json (a JSON schema), regex, choice (one of a list of strings), grammar (EBNF, as
xgrammar/GBNF read it) or json_object (any JSON object) is set. Only the shape is checked here, so
the router can refuse a malformed spec without importing the grammar engine (xgrammar pulls in
torch); the engine compiles it (pdcluster/engine/structured_output.py) and refuses, naming the
field, what the grammar engine cannot compile.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# A spec is compiled once per engine and cached; big specs cost compile time and cache memory.
MAX_SPEC_CHARS = 64 * 1024
# xgrammar's compile time grows steeply with a schema's nesting (arrays of arrays, the demo
# tokenizer: 100 levels 0.11 s, 900 levels 40 s, on a worker thread per request).
MAX_SCHEMA_DEPTH = 64
MAX_CHOICES = 256
# Optional properties cost the grammar compile more than linearly (xgrammar 0.1, measured on a
# 2-vCPU EPYC: 200 optional properties of one object 0.10 s, 400 0.43 s, 800 4.7 s, 2000 34 s),
# so a schema is bounded by them, per object and in all; required ones cost next to nothing.
MAX_OPTIONAL_PROPERTIES = 256
MAX_OPTIONAL_PROPERTIES_TOTAL = 1024
KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True, init=False)
class StructuredOutputs:
    json: str | None = None  # canonical JSON text of the schema
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __init__(self, *, json: Any = None, regex: str | None = None,  # noqa: A002 - vLLM's names
                 choice: Any = None, grammar: str | None = None, json_object: bool = False) -> None:
        given = [k for k, v in (("json", json), ("regex", regex), ("choice", choice), ("grammar", grammar),
                                ("json_object", json_object or None)) if v is not None]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {list(KINDS)}, got {given or 'none'}")
        if not isinstance(json_object, bool):
            raise ValueError("structured_outputs.json_object must be a boolean")
        object.__setattr__(self, "json", None if json is None else _schema_text(json))
        object.__setattr__(self, "regex", None if regex is None else _text("regex", regex))
        object.__setattr__(self, "choice", None if choice is None else _choices(choice))
        object.__setattr__(self, "grammar", None if grammar is None else _text("grammar", grammar))
        object.__setattr__(self, "json_object", json_object)

    @classmethod
    def coerce(cls, value: Any) -> StructuredOutputs | None:
        """A StructuredOutputs, a dict of its fields (transport), or None."""
        if value is None or isinstance(value, StructuredOutputs):
            return value
        if not isinstance(value, dict):
            raise ValueError("structured_outputs must be an object")
        unknown = sorted(set(value) - set(KINDS))
        if unknown:
            raise ValueError(f"structured_outputs: unknown field(s) {unknown}; known: {list(KINDS)}")
        return cls(**{k: v for k, v in value.items() if v is not None})

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, spec text): the grammar cache key."""
        kind = self.kind
        if kind == "choice":
            return kind, json.dumps(list(self.choice or ()), ensure_ascii=False)
        if kind == "json_object":
            return kind, ""
        return kind, getattr(self, kind)

    def to_dict(self) -> dict[str, Any]:
        kind = self.kind
        return {kind: list(self.choice or ()) if kind == "choice" else getattr(self, kind)}


def _text(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"structured_outputs.{name} must be a non-empty string")
    if len(value) > MAX_SPEC_CHARS:
        raise ValueError(f"structured_outputs.{name} is {len(value)} characters; at most {MAX_SPEC_CHARS} allowed")
    return value


def _schema_text(value: Any) -> str:
    if isinstance(value, str):
        _text("json", value)
        try:
            value = json.loads(value)
        except RecursionError:
            raise ValueError(f"structured_outputs.json nests deeper than {MAX_SCHEMA_DEPTH} levels") from None
        except ValueError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
    if not isinstance(value, (dict, bool)):
        raise ValueError("structured_outputs.json must be a JSON schema (an object or a boolean)")
    _check_schema_shape(value)  # before json.dumps, which recurses per level too
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    _text("json", text)
    return text


def _check_schema_shape(schema: Any) -> None:
    """ValueError when the schema nests deeper than MAX_SCHEMA_DEPTH, when an object schema has
    more optional properties than MAX_OPTIONAL_PROPERTIES, or the whole schema more than
    MAX_OPTIONAL_PROPERTIES_TOTAL. One iterative walk: any depth is counted, none recursed into."""
    total, stack = 0, [(schema, 1)]
    while stack:
        node, level = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        if level > MAX_SCHEMA_DEPTH:
            raise ValueError(f"structured_outputs.json nests deeper than {MAX_SCHEMA_DEPTH} levels")
        if isinstance(node, list):
            stack.extend((child, level + 1) for child in node)
            continue
        props = node.get("properties")
        if isinstance(props, dict):
            required = node.get("required")
            required = set(required) if isinstance(required, list) and all(isinstance(r, str) for r in required) else set()
            optional = len(set(props) - required)
            if optional > MAX_OPTIONAL_PROPERTIES:
                raise ValueError(f"structured_outputs.json: an object schema has {optional} optional properties; at most "
                                 f"{MAX_OPTIONAL_PROPERTIES} allowed (list the others in 'required')")
            total += optional
            if total > MAX_OPTIONAL_PROPERTIES_TOTAL:
                raise ValueError(f"structured_outputs.json: the schema has more than {MAX_OPTIONAL_PROPERTIES_TOTAL} "
                                 "optional properties in all")
        stack.extend((child, level + 1) for child in node.values())


def _choices(value: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError("structured_outputs.choice must be a non-empty list of strings")
    if len(value) > MAX_CHOICES:
        raise ValueError(f"structured_outputs.choice has {len(value)} entries; at most {MAX_CHOICES} allowed")
    if not all(isinstance(c, str) and c for c in value):
        raise ValueError("structured_outputs.choice must be a list of non-empty strings")
    if sum(len(c) for c in value) > MAX_SPEC_CHARS:
        raise ValueError(f"structured_outputs.choice is longer than {MAX_SPEC_CHARS} characters in all")
    return tuple(value)
