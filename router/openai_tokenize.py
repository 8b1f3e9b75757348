"""vLLM's /tokenize and /detokenize, answered by the router's own tokenizer (no worker involved).

    POST /tokenize    {"prompt": str, "add_special_tokens": bool = true}
                      or {"messages": [...], "add_generation_prompt": bool = true, "chat_template_kwargs": {...},
                          "continue_final_message": bool = false, "add_special_tokens": bool = false}
                      -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize  {"tokens": [int, ...]} -> {"prompt": str}

Both accept "model" (checked like the generation endpoints) and refuse any other field by name.
"""

from __future__ import annotations

from typing import Any

from pdcluster._proto import router_pb2

from .errors import invalid
from .openai_protocol import MAX_MESSAGES, parse_chat
from .preprocess import Preprocessor

MAX_DETOKENIZE_TOKENS = 1 << 20


async def tokenize(pre: Preprocessor, body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise invalid("body", "the request body must be a JSON object")
    if "messages" in body:
        chat_fields = ("model", "messages", "add_generation_prompt", "chat_template_kwargs", "continue_final_message",
                       "add_special_tokens")
        _check(body, {*chat_fields, "return_token_strs"})
        chat_body = {k: v for k, v in body.items() if k in chat_fields}
        if isinstance(body.get("messages"), list) and len(body["messages"]) > MAX_MESSAGES:
            raise invalid("messages", f"at most {MAX_MESSAGES} messages")
        req, _ = parse_chat(chat_body, pre.model_name)
    else:
        _check(body, {"model", "prompt", "add_special_tokens", "return_token_strs"})
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise invalid("prompt", "must be a string")
        req = router_pb2.GenerateRequest(model=body.get("model") or "", prompt=prompt)
        add_special = body.get("add_special_tokens", True)
        if not isinstance(add_special, bool):
            raise invalid("add_special_tokens", "must be a boolean")
        req.add_special_tokens = add_special
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("model", "must be a string")
    pre.check_model(req.model)
    return _answer(pre, await pre.tokenize(req), body)


def detokenize(pre: Preprocessor, body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise invalid("body", "the request body must be a JSON object")
    _check(body, {"model", "tokens"})
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("model", "must be a string")
    pre.check_model(model or "")
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or len(tokens) > MAX_DETOKENIZE_TOKENS:
        raise invalid("tokens", f"must be a list of at most {MAX_DETOKENIZE_TOKENS} token ids")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < pre.vocab_size for t in tokens):
        raise invalid("tokens", f"token ids must be integers in [0, {pre.vocab_size})")
    return {"prompt": pre.tokenizer.decode(tokens)}


def _answer(pre: Preprocessor, ids: list[int], body: dict) -> dict[str, Any]:
    strs = body.get("return_token_strs")
    if strs is not None and not isinstance(strs, bool):
        raise invalid("return_token_strs", "must be a boolean")
    token_strs = pre.tokenizer.convert_ids_to_tokens(ids) if strs else None
    return {"count": len(ids), "max_model_len": pre.max_model_len, "tokens": ids, "token_strs": token_strs}


def _check(body: dict, allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise invalid(unknown[0], f"unknown field {unknown[0]!r}; this server does not support it")
