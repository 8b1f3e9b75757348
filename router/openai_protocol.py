"""OpenAI request bodies -> GenerateRequest protos (the router's one internal request shape).

Only JSON shapes and types are checked here, each failure naming its field; ranges and
cross-field rules are checked once for both frontends by SamplingParams in the Preprocessor.
Every accepted field is honoured; any other field, and features this server does not have
(suffix, tools outside chat, ...), are refused by name rather than silently ignored.
`n`, `best_of`, `echo` and batched prompts are the HTTP frontend's (openai_fanout.py): each
GenerateRequest here is one prompt, sampled once.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from pdcluster._proto import common_pb2, router_pb2
from pdcluster.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)

from .errors import invalid
from .openai_images import ImageLimits, chat_parts
from .openai_structured import FIELDS as STRUCTURED_FIELDS
from .openai_structured import parse_structured
from .openai_tools import ToolMode, chat_message_tool_fields, parse_tools
from .reasoning import ReasoningParser

# JSON field -> (proto SamplingParams field, kind). The vLLM extras are honoured like the rest.
_SAMPLING_FIELDS: dict[str, tuple[str, str]] = {
    "temperature": ("temperature", "number"),
    "top_p": ("top_p", "number"),
    "presence_penalty": ("presence_penalty", "number"),
    "frequency_penalty": ("frequency_penalty", "number"),
    "seed": ("seed", "int"),
    "top_k": ("top_k", "int"),
    "min_p": ("min_p", "number"),
    "repetition_penalty": ("repetition_penalty", "number"),
    "min_tokens": ("min_tokens", "int"),
    "ignore_eos": ("ignore_eos", "bool"),
    "include_stop_str_in_output": ("include_stop_str_in_output", "bool"),
    "skip_special_tokens": ("skip_special_tokens", "bool"),
    "cache_salt": ("cache_salt", "string"),
    "truncate_prompt_tokens": ("truncate_prompt_tokens", "int"),
    "priority": ("priority", "int"),
}
# Field -> the value that means "not used"; anything else is refused as unsupported.
_UNSUPPORTED = {"suffix": None, "tools": None, "tool_choice": "none", "functions": None, "function_call": None}
# Every field a body may carry; anything else is refused by name. `user` is an opaque end-user id
# (nothing to honour); `parallel_tool_calls` only qualifies tools, which are refused.
_COMMON_FIELDS = frozenset({"model", "max_tokens", "stop", "stop_token_ids", "stream", "stream_options", "n",
                            "allowed_token_ids", "bad_words", "return_token_ids", "request_id",
                            "logit_bias", "user", "prompt_logprobs", *_SAMPLING_FIELDS, *_UNSUPPORTED,
                            *STRUCTURED_FIELDS})
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "logprobs", "echo", "best_of", "add_special_tokens"}
CHAT_FIELDS = _COMMON_FIELDS | {"messages", "add_generation_prompt", "chat_template_kwargs", "include_reasoning",
                                "continue_final_message", "add_special_tokens", "echo",
                                "logprobs", "top_logprobs",
                                "max_completion_tokens", "parallel_tool_calls"}
# Choices per request (n, best_of) and prompts per batch: each is a generation on the workers.
MAX_PROMPTS = 64
MAX_GENERATIONS = 256
_MAX_TOKEN_ID = 0xFFFFFFFF
# Lists are counted before anything walks them (the finer limits are checked later, once, for
# both frontends: the configured stop_token_ids bound and the vocabulary in the Preprocessor).
MAX_MESSAGES = 4096
MAX_USER_CHARS = 256


@dataclass(frozen=True)
class OpenAIOptions:
    """What the HTTP frontend needs besides the GenerateRequest to shape the answer."""

    model: str
    stream: bool
    include_usage: bool
    logprobs: int | None  # top-n alternatives requested (None: no logprobs in the answer)
    chat: bool
    n: int = 1             # choices returned per prompt
    best_of: int = 1       # generations per prompt (>= n); the n with the highest cumulative logprob win
    echo: bool = False     # the prompt's text (chat: a final assistant message's) before each choice's text
    structured_field: str | None = None  # the structured-output field the client used
    tools: ToolMode | None = None  # chat with tools: how to read tool calls out of the answer
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: the prompt's logprobs in the answer
    reasoning: ReasoningParser | None = None  # chat: split the thought out (the server's --reasoning-parser)
    include_reasoning: bool = True  # vLLM's include_reasoning: false drops the thought from the answer
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every chunk
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids in the answer


def parse_completion(body: Any, default_model: str) -> tuple[router_pb2.GenerateRequest, OpenAIOptions]:
    """One prompt (a batch of one included)."""
    reqs, opts = parse_completions(body, default_model)
    if len(reqs) != 1:
        raise invalid("prompt", "expected one prompt")
    return reqs[0], opts


def parse_completions(body: Any, default_model: str) -> tuple[list[router_pb2.GenerateRequest], OpenAIOptions]:
    """A completion body -> one GenerateRequest per prompt (a batch: a list of strings or of token
    lists), each sampled once; n, best_of and echo are in the options."""
    body = _object(body)
    _check_fields(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        prompts = prompt  # a batch
    else:
        prompts = [prompt]
    if len(prompts) > MAX_PROMPTS:
        raise invalid("prompt", f"prompt has {len(prompts)} prompts; at most {MAX_PROMPTS} allowed")
    reqs = [_one_prompt(p) for p in prompts]
    req = reqs[0]
    logprobs = body.get("logprobs")
    if logprobs is not None and not _is_int(logprobs):
        raise invalid("logprobs", "must be an integer (the number of top logprobs)")
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise invalid("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {logprobs}")
    echo = _bool(body, "echo", False)
    if echo and logprobs is not None and _bool(body, "stream", False):
        raise invalid("echo", "echo with logprobs cannot be streamed by this server (the prompt's logprobs come "
                      "with the whole answer)")
    opts = _common(body, req, default_model, chat=False, logprobs=logprobs, echo=echo)
    if echo and logprobs is not None and not req.sampling_params.HasField("prompt_logprobs"):
        req.sampling_params.prompt_logprobs = logprobs  # the echoed prompt's tokens carry logprobs too
    if opts.n * opts.best_of * len(reqs) > MAX_GENERATIONS:
        raise invalid("prompt", f"{len(reqs)} prompts x best_of={opts.best_of} exceed {MAX_GENERATIONS} generations")
    special = body.get("add_special_tokens")
    if special is not None:
        if not isinstance(special, bool):
            raise invalid("add_special_tokens", "must be a boolean")
        texts = [r for r in reqs if r.WhichOneof("input") == "prompt"]  # token ids are taken as given
        if special and not texts:
            raise invalid("add_special_tokens", "a prompt of token ids is taken as given: nothing is added to it")
        for r in texts:
            r.add_special_tokens = special
    for other in reqs[1:]:
        other.model = req.model
        other.stream = req.stream
        other.sampling_params.CopyFrom(req.sampling_params)
    return reqs, opts


def _one_prompt(prompt: Any) -> router_pb2.GenerateRequest:
    req = router_pb2.GenerateRequest()
    if isinstance(prompt, str):
        req.prompt = prompt
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        if any(not 0 <= t <= _MAX_TOKEN_ID for t in prompt):
            raise invalid("prompt", "token ids must be non-negative integers")
        req.prompt_token_ids.ids.extend(prompt)
    else:
        raise invalid("prompt", "must be a string, a non-empty list of token ids, or a list of either")
    return req


def parse_chat(body: Any, default_model: str, image_limits: ImageLimits | None = None
               ) -> tuple[router_pb2.GenerateRequest, OpenAIOptions]:
    """image_limits: the router's (RouterConfig); image_url parts are decoded here under them."""
    image_limits = image_limits or ImageLimits()
    num_images = 0
    body = _object(body)
    _check_fields(body, CHAT_FIELDS)
    req = router_pb2.GenerateRequest()
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "must be a non-empty list of messages")
    if len(messages) > MAX_MESSAGES:
        raise invalid("messages", f"messages has {len(messages)} entries; at most {MAX_MESSAGES} allowed")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise invalid("messages", f"messages[{i}] must be an object with a string 'role'")
        content = m.get("content")
        if _has_image(content):
            parts, images = chat_parts(content, i, image_limits, num_images)
            msg = req.chat.messages.add(role=m["role"])
            it = iter(images)
            for part in parts:
                if part["type"] == "image":
                    msg.parts.add(image=next(it))
                else:
                    msg.parts.add(text=part["text"])
            num_images += len(images)
        else:
            msg = req.chat.messages.add(role=m["role"], content=_content(content, i))
        name = m.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise invalid("messages", f"messages[{i}].name must be a string")
            msg.name = name
        chat_message_tool_fields(m, i, msg)
        _message_extras(m, i, msg)
    req.chat.add_generation_prompt = _bool(body, "add_generation_prompt", True)
    req.chat.continue_final_message = _bool(body, "continue_final_message", False)
    if body.get("add_special_tokens") is not None:
        req.add_special_tokens = _bool(body, "add_special_tokens", False)
    variables = body.get("chat_template_kwargs")
    if variables is not None:  # the names are checked once, for both frontends, by the Preprocessor
        if not isinstance(variables, dict):
            raise invalid("chat_template_kwargs", "must be a JSON object of template variables")
        if variables:
            req.chat.template_kwargs_json = json.dumps(variables, ensure_ascii=False)
    logprobs = None
    if _bool(body, "logprobs", False):
        top = body.get("top_logprobs")
        if top is not None and not _is_int(top):
            raise invalid("top_logprobs", "must be an integer")
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise invalid("top_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {top}")
        logprobs = top or 0
    elif body.get("top_logprobs") is not None:
        raise invalid("top_logprobs", "requires logprobs=true")
    limit = body.get("max_completion_tokens")
    if limit is not None:  # OpenAI's newer name for max_tokens; it wins when both are sent
        if not _is_int(limit) or limit < 1:
            raise invalid("max_completion_tokens", f"must be an integer >= 1, got {limit!r}")
        body = {**body, "max_tokens": limit}
    opts = _common(body, req, default_model, chat=True, logprobs=logprobs, echo=_bool(body, "echo", False))
    opts = dataclasses.replace(opts, include_reasoning=_bool(body, "include_reasoning", True))
    tools = parse_tools(body, req.chat, req.sampling_params, opts.structured_field)
    if tools is not None and opts.echo:
        raise invalid("echo", "echo cannot be combined with tools (an answer may be tool calls, not text)")
    if tools is not None:
        # A forced call compiles the tools' schemas: a worker's refusal of it names `tools`.
        field = "tools" if tools.choice in ("required", "named") else opts.structured_field
        opts = dataclasses.replace(opts, tools=tools, structured_field=field)
    return req, opts


def _check_fields(body: dict, allowed: frozenset[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise invalid(unknown[0], f"unknown field {unknown[0]!r}; this server does not support it")


def _common(body: dict, req: router_pb2.GenerateRequest, default_model: str, *, chat: bool,
            logprobs: int | None, echo: bool = False) -> OpenAIOptions:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("model", "must be a string")
    req.model = model or ""
    request_id = body.get("request_id")  # vLLM's; an X-Request-Id header wins, as there
    if request_id is not None:
        if not isinstance(request_id, str):
            raise invalid("request_id", "must be a string")
        req.request_id = request_id  # its length and characters: the Preprocessor's check
    user = body.get("user")  # an opaque end-user id: nothing to honour, but it must be one
    if user is not None and (not isinstance(user, str) or len(user) > MAX_USER_CHARS):
        raise invalid("user", f"must be a string of at most {MAX_USER_CHARS} characters")
    if chat:
        _bool(body, "parallel_tool_calls", True)
    for name, ok in _UNSUPPORTED.items():
        if chat and name in ("tools", "tool_choice"):
            continue  # chat serves them (openai_tools.py)
        value = body.get(name)
        if value is not None and value != ok and value != {} and value != []:
            raise invalid(name, f"{name}={value!r} is not supported by this server")
    sp = req.sampling_params
    _fill_sampling(body, sp)
    prompt_logprobs = body.get("prompt_logprobs")
    if prompt_logprobs is not None:
        if not _is_int(prompt_logprobs) or not 0 <= prompt_logprobs <= MAX_LOGPROBS:
            raise invalid("prompt_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {prompt_logprobs!r}")
        if _bool(body, "stream", False):
            raise invalid("prompt_logprobs", "cannot be streamed by this server: ask without stream")
        sp.prompt_logprobs = prompt_logprobs
    structured = parse_structured(body, sp)
    n = _count(body, "n", 1, 1)
    best_of = n if chat else _count(body, "best_of", n, n)
    if logprobs is not None:
        _set(sp, "logprobs", logprobs, "logprobs" if not chat else "top_logprobs")
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    include_usage = continuous_usage = False
    if options is not None:
        if not stream:
            raise invalid("stream_options", "only allowed when stream is true")
        if not isinstance(options, dict):
            raise invalid("stream_options", "must be an object")
        unknown = sorted(set(options) - {"include_usage", "continuous_usage_stats"})
        if unknown:
            raise invalid("stream_options", f"unknown field(s) {unknown}; known: ['continuous_usage_stats', "
                                            "'include_usage']")
        include_usage = _bool(options, "include_usage", False, "stream_options.include_usage")
        # vLLM's: the running usage on every chunk (it implies the final usage chunk too).
        continuous_usage = _bool(options, "continuous_usage_stats", False, "stream_options.continuous_usage_stats")
        include_usage = include_usage or continuous_usage
    if stream and best_of > n:
        raise invalid("best_of", "best_of > n cannot be streamed (the best are known only at the end)")
    req.stream = stream
    return OpenAIOptions(model or default_model, stream, include_usage, logprobs, chat, n, best_of, echo, structured,
                         continuous_usage=continuous_usage,
                         prompt_logprobs=prompt_logprobs,
                         return_token_ids=_bool(body, "return_token_ids", False))


# A message's keys: those read above; the thought of an earlier answer; and what OpenAI's SDK
# writes into an answer it hands back as history (null or empty there: nothing to honour).
_MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "reasoning", "reasoning_content"})
_EMPTY_MESSAGE_KEYS = frozenset({"refusal", "annotations", "audio", "function_call"})


def _message_extras(m: dict, i: int, msg: Any) -> None:
    """The thought of an earlier assistant answer goes to the template; any other key is refused
    by name unless it is one of the SDK's empty ones."""
    for key, value in m.items():
        if key in _MESSAGE_KEYS:
            continue
        if key in _EMPTY_MESSAGE_KEYS and value in (None, "", [], {}):
            continue
        raise invalid("messages", f"messages[{i}].{str(key)[:64]} is not supported")
    thought = m.get("reasoning_content")
    if thought is None:  # vLLM 0.32's name; a null reasoning_content beside it does not hide it
        thought = m.get("reasoning")
    if thought is not None:
        if not isinstance(thought, str):
            raise invalid("messages", f"messages[{i}].reasoning must be a string")
        if m["role"] != "assistant":
            raise invalid("messages", f"messages[{i}].reasoning: only an assistant message has one")
        msg.reasoning_content = thought


def _count(body: dict, name: str, default: int, low: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value):
        raise invalid(name, "must be an integer")
    if not low <= value <= MAX_N:
        raise invalid(name, f"must be in [{low}, {MAX_N}], got {value}")
    return value


def _fill_sampling(body: dict, sp: common_pb2.SamplingParams) -> None:
    max_tokens = body.get("max_tokens")
    if max_tokens is not None:
        if not _is_int(max_tokens):
            raise invalid("max_tokens", "must be an integer")
        _set(sp, "max_tokens", max_tokens, "max_tokens")
    for name, (field, kind) in _SAMPLING_FIELDS.items():
        value = body.get(name)
        if value is None:
            continue
        if kind == "number" and not (_is_int(value) or isinstance(value, float)):
            raise invalid(name, "must be a number")
        if kind == "int" and not _is_int(value):
            raise invalid(name, "must be an integer")
        if kind == "bool" and not isinstance(value, bool):
            raise invalid(name, "must be a boolean")
        if kind == "string" and not isinstance(value, str):
            raise invalid(name, "must be a string")
        _set(sp, field, value, name)
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
            raise invalid("stop", f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} allowed")
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise invalid("stop", "must be a string or a list of strings")
        sp.stop.extend(stop)
    for name, limit in (("stop_token_ids", MAX_STOP_TOKEN_IDS), ("allowed_token_ids", MAX_ALLOWED_TOKEN_IDS)):
        ids = body.get(name)
        if ids is not None:
            if isinstance(ids, list) and len(ids) > limit:
                raise invalid(name, f"{name} has {len(ids)} ids; at most {limit} allowed")
            if not isinstance(ids, list) or not all(_is_int(t) and 0 <= t <= _MAX_TOKEN_ID for t in ids):
                raise invalid(name, "must be a list of non-negative integers")
            getattr(sp, name).extend(ids)
    words = body.get("bad_words")
    if words is not None:
        if isinstance(words, list) and len(words) > MAX_BAD_WORDS:
            raise invalid("bad_words", f"bad_words has {len(words)} words; at most {MAX_BAD_WORDS} allowed")
        if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
            raise invalid("bad_words", "must be a list of strings")
        sp.bad_words.extend(words)
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise invalid("logit_bias", "must be an object mapping token ids to biases")
        if len(bias) > MAX_LOGIT_BIAS:
            raise invalid("logit_bias", f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS} allowed")
        for key, value in bias.items():
            if not (isinstance(key, str) and key.isdigit() and int(key) <= _MAX_TOKEN_ID):
                raise invalid("logit_bias", f"keys must be token ids, got {key!r}")
            if not (_is_int(value) or isinstance(value, float)):
                raise invalid("logit_bias", f"values must be numbers, got {value!r}")
            sp.logit_bias[int(key)] = value


def _set(msg: Any, field: str, value: Any, name: str) -> None:
    try:
        setattr(msg, field, value)
    except (ValueError, TypeError, OverflowError):  # out of the proto type's range (uint32, ...)
        raise invalid(name, f"value {value!r} is out of range") from None


def _has_image(content: Any) -> bool:
    return isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image_url" for p in content)


def _content(content: Any, i: int) -> str:
    """Message content without images: a string, or a list of text parts (joined). Other part
    types (audio, ...) are refused; messages with image_url parts go through chat_parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid("messages", f"messages[{i}].content: only text parts are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise invalid("messages", f"messages[{i}].content must be a string or a list of text parts")


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise invalid("body", "the request body must be a JSON object")
    return body


def _bool(body: dict, name: str, default: bool, label: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(label or name, "must be a boolean")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def chat_echo_text(req: router_pb2.GenerateRequest) -> str:
    """What a chat answer's echo puts before it: the final message's text when the model speaks
    in its role (an assistant message, continued), otherwise nothing (vLLM's rule)."""
    last = req.chat.messages[-1]
    if last.role != "assistant":
        return ""
    return "".join(p.text for p in last.parts if p.WhichOneof("part") == "text") if last.parts else last.content
