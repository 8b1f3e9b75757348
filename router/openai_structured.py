"""OpenAI/vLLM structured-output fields -> the proto StructuredOutputs of a request.

Accepted (at most one per request): `response_format` ({"type": "text" | "json_object" |
"json_schema", "json_schema": {"name", "schema", "strict"}}), vLLM's `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`, and vLLM's newer `structured_outputs`
({"json" | "regex" | "choice" | "grammar" | "json_object": ...}). Only the shape is checked here
(pdcluster.structured_spec, no torch); the worker compiles the grammar and refuses what xgrammar
cannot compile, which the HTTP frontend reports under the field the client used.
"""

from __future__ import annotations

from typing import Any

from pdcluster._proto import common_pb2
from pdcluster.structured_spec import KINDS, StructuredOutputs

from .errors import invalid

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
FIELDS = ("response_format", *_GUIDED, "structured_outputs")


def parse_structured(body: dict, sp: common_pb2.SamplingParams) -> str | None:
    """Fill sp.structured_outputs from the body; returns the name of the field used (or None)."""
    found: list[tuple[str, dict[str, Any]]] = []
    fmt = body.get("response_format")
    if fmt is not None:
        spec = _response_format(fmt)
        if spec is not None:
            found.append(("response_format", spec))
    for name, kind in _GUIDED.items():
        value = body.get(name)
        if value is not None:
            found.append((name, {kind: value}))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise invalid("structured_outputs", f"must be an object with one of {list(KINDS)}")
        found.append(("structured_outputs", {k: v for k, v in so.items() if v is not None and v is not False}))
    if not found:
        return None
    if len(found) > 1:
        raise invalid(found[1][0], f"only one structured-output field may be set; got {[f for f, _ in found]}")
    name, spec = found[0]
    try:
        parsed = StructuredOutputs.coerce(spec)
    except ValueError as e:
        text = str(e)
        for kind in KINDS:
            text = text.replace(f"structured_outputs.{kind}", name)
        raise invalid(name, text.replace("structured_outputs", name, 1)) from None
    assert parsed is not None
    msg = sp.structured_outputs
    for kind, value in parsed.to_dict().items():
        if kind == "choice":
            msg.choice.extend(value)
        else:
            setattr(msg, kind, value)
    return name


def _response_format(fmt: Any) -> dict[str, Any] | None:
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise invalid("response_format", "must be an object with a string 'type'")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        js = fmt.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise invalid("response_format", "json_schema must be an object with a 'schema'")
        return {"json": js["schema"]}
    raise invalid("response_format", f"type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
