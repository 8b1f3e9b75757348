"""Preprocessor: a client's GenerateRequest -> a validated, tokenized PreparedRequest.

Both frontends go through here (the HTTP frontend first maps OpenAI JSON onto a
GenerateRequest), so a field is validated once, the same way, for everybody. Every refusal is a
RouterError naming the field: INVALID_ARGUMENT, or NOT_FOUND for a model this router does not
serve.
"""

from __future__ import annotations

import asyncio
import functools
import secrets
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import jinja2

from pdcluster._proto import common_pb2, router_pb2
from pdcluster.engine.tokenizer import Tokenizer
from pdcluster.generation_defaults import GenerationDefaults
from pdcluster.sampling_params import (
    DEFAULT_MAX_STOP_TOKEN_IDS,
    MAX_ALLOWED_TOKEN_IDS,
    SamplingParams,
    truncated,
)

from .config import DEFAULT_MAX_JSON_DEPTH, DEFAULT_MAX_MESSAGE_BYTES
from .convert import sampling_params_from_proto
from .errors import RouterError, invalid
from .json_text import loads_bounded
from .openai_images import (
    ImageLimits,
    ImagePlaceholders,
    check_image_bytes,
    expand_placeholders,
    wants_typed_parts,
)

MAX_REQUEST_ID_LEN = 256
MAX_CHAT_MESSAGES = 4096
# chat_template_kwargs: extra variables for the template, never the ones the server sets.
MAX_TEMPLATE_KWARGS = 32
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
# Prompts longer than this are tokenized off the event loop: other requests keep streaming.
_OFFLOAD_CHARS = 16384
_PREFIX_MARGIN_TOKENS = 64  # a prefix cut mid-word tokenizes into at most a few extra tokens
DEFAULT_PARAMS_CACHE_BYTES = 4 << 20
# One logprob value in a serialized answer, generously: token id, logprob, rank, its text, framing
# (measured: ~22 bytes on average over 8,400 values of the demo model's answers).
LOGPROB_VALUE_BYTES = 48
# What one memoised entry costs beside its key: the frozen dataclass, its tuples, the dict slot.
_ENTRY_OVERHEAD = 1024


@dataclass
class PreparedRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: common_pb2.SamplingParams  # validated; what the workers get
    max_tokens: int                             # resolved (the default applied)
    stream: bool = True
    deadline: float | None = None               # time.monotonic() deadline
    return_prompt_token_ids: bool = False
    arrival: float = field(default_factory=time.monotonic)
    images: list[bytes] = field(default_factory=list)  # encoded, prompt order; placeholders expanded in the ids
    mm_offset: int | None = None  # index of the first image placeholder (None: no images); prefix routing stops there

    def remaining(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()


class Preprocessor:
    def __init__(self, tokenizer: Tokenizer, *, served_model_names: Collection[str], vocab_size: int | None = None,
                 max_model_len: int | None = None, max_stop_token_ids: int = DEFAULT_MAX_STOP_TOKEN_IDS,
                 params_cache_bytes: int = DEFAULT_PARAMS_CACHE_BYTES,
                 image_placeholders: ImagePlaceholders | None = None,
                 image_limits: ImageLimits | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 max_json_depth: int = DEFAULT_MAX_JSON_DEPTH,
                 generation_defaults: GenerationDefaults | None = None) -> None:
        self.tokenizer = tokenizer
        # --generation-config: the checkpoint's sampling defaults for fields a request leaves out.
        self.generation_defaults = generation_defaults or GenerationDefaults()
        self._sampling_defaults = self.generation_defaults.sampling
        self.max_message_bytes = max_message_bytes
        self.max_json_depth = max_json_depth  # JSON in a request's string fields (tools, template variables)
        # chat_template_kwargs may not set these; the tokenizer's special tokens are the server's too.
        self._reserved_variables = RESERVED_TEMPLATE_VARIABLES.union(tokenizer.special_tokens)
        # A multimodal model's image token and count (None: text-only, images refused), and the
        # limits on images per request and bytes per image.
        self.image_placeholders = image_placeholders
        self.image_limits = image_limits or ImageLimits()
        self._typed_parts = image_placeholders is not None and wants_typed_parts(tokenizer.chat_template)
        self.served_model_names = tuple(served_model_names)
        self._names = frozenset(self.served_model_names)
        self.vocab_size = vocab_size or tokenizer.vocab_size
        self.max_model_len = max_model_len
        self.max_stop_token_ids = max_stop_token_ids
        # Most clients send the same few parameter sets: validated ones are memoised by their
        # bytes (SamplingParams is frozen; only valid sets are kept). Bounded by bytes, not
        # entries: the oldest entries go first once the estimated size exceeds the budget.
        self._params_cache: dict[bytes, SamplingParams] = {}
        self._params_cache_bytes = 0
        self._params_cache_budget = params_cache_bytes

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def _json_field(self, text: str, field: str, what: str) -> Any:
        return loads_bounded(text, self.max_json_depth, field, what)

    def _template_kwargs(self, text: str) -> dict[str, Any]:
        return _check_template_kwargs(self._json_field(text, "chat_template_kwargs", "chat_template_kwargs"),
                                      self._reserved_variables)

    def token_text(self, token_id: int) -> str:
        """One token's text (logprobs when the worker sent no decoded text)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def check_model(self, name: str) -> None:
        if name and name not in self._names:
            raise RouterError(grpc.StatusCode.NOT_FOUND,
                              f"model {name!r} does not exist; this router serves {list(self.served_model_names)}",
                              "model")

    async def prepare(self, req: router_pb2.GenerateRequest, timeout_s: float | None, *,
                      chat_max_tokens_default: bool = False) -> PreparedRequest:
        """Validate and tokenize. chat_max_tokens_default: an unset max_tokens means 'the rest of
        the context' (OpenAI chat) instead of SamplingParams' 16."""
        self.check_model(req.model)
        # 128 random bits as 32 hex digits, like uuid4().hex, at a seventh of its cost.
        request_id = _check_request_id(req.request_id) or secrets.token_hex(16)
        sp = self._with_defaults(req.sampling_params)
        params = self._validate_params(sp)
        truncate = params.truncate_prompt_tokens
        prompt_ids, images = await self._prompt_token_ids(req, refuse_long=truncate is None)
        if truncate is not None:
            if images:
                raise invalid("truncate_prompt_tokens", "cannot be combined with images (a cut could split one)")
            prompt_ids = truncated(prompt_ids, truncate, self.max_model_len, params.max_tokens)
        pb = common_pb2.SamplingParams()
        pb.CopyFrom(sp)
        max_tokens = params.max_tokens
        if not req.sampling_params.HasField("max_tokens") and chat_max_tokens_default and self.max_model_len:
            max_tokens = max(1, self.max_model_len - len(prompt_ids))
            if self.generation_defaults.max_tokens is not None:  # the checkpoint's max_new_tokens
                max_tokens = min(max_tokens, self.generation_defaults.max_tokens)
            pb.max_tokens = max_tokens
        self._check_length(len(prompt_ids), max_tokens)
        self._check_logprob_volume(len(prompt_ids), max_tokens, params, req.stream)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        mm_offset = None
        if images and self.image_placeholders is not None:
            mm_offset = prompt_ids.index(self.image_placeholders.image_token_id)
        return PreparedRequest(request_id, prompt_ids, pb, max_tokens, req.stream, deadline,
                               req.return_prompt_token_ids, images=images, mm_offset=mm_offset)

    def _with_defaults(self, sp: common_pb2.SamplingParams) -> common_pb2.SamplingParams:
        missing = [(name, value) for name, value in self._sampling_defaults.items() if not sp.HasField(name)]
        if not missing:
            return sp
        out = common_pb2.SamplingParams()
        out.CopyFrom(sp)
        for name, value in missing:
            setattr(out, name, value)
        return out

    def _validate_params(self, pb: common_pb2.SamplingParams) -> SamplingParams:
        key = pb.SerializeToString(deterministic=True)
        params = self._params_cache.get(key)
        if params is None:
            self._check_stop_token_ids(pb.stop_token_ids)
            if len(pb.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS:  # before anything scans them
                raise invalid("allowed_token_ids", f"allowed_token_ids has {len(pb.allowed_token_ids)} ids; at most "
                              f"{MAX_ALLOWED_TOKEN_IDS} allowed")
            for name, ids in (("logit_bias", pb.logit_bias), ("allowed_token_ids", pb.allowed_token_ids)):
                if ids and max(ids) >= self.vocab_size:
                    raise invalid(name, f"token id {max(ids)} is out of range [0, {self.vocab_size})")
            params = sampling_params_from_proto(pb)
            if params.n != 1:  # the HTTP frontend fans n out before it gets here (openai_fanout.py)
                raise invalid("n", f"n must be 1 on gRPC (got {params.n}): a Generate stream carries one "
                                   "sequence; send n requests, or use the HTTP frontend's n")
            self._memoise(key, params)
        return params

    def _check_stop_token_ids(self, ids: Sequence[int]) -> None:
        """Before SamplingParams scans them: the configured count, then each id in the vocabulary."""
        if len(ids) > self.max_stop_token_ids:
            raise invalid("stop_token_ids", f"stop_token_ids has {len(ids)} ids; at most "
                          f"{self.max_stop_token_ids} allowed")
        if ids and max(ids) >= self.vocab_size:
            raise invalid("stop_token_ids", f"token id {max(ids)} is out of range [0, {self.vocab_size})")

    def _memoise(self, key: bytes, params: SamplingParams) -> None:
        cost = 2 * len(key) + _ENTRY_OVERHEAD  # the key, and the params it decodes to (about as big)
        if cost * 16 > self._params_cache_budget:
            return  # one entry may not take a large share: such sets are validated each time
        cache = self._params_cache
        while cache and self._params_cache_bytes + cost > self._params_cache_budget:
            old = next(iter(cache))  # insertion order: the oldest
            del cache[old]
            self._params_cache_bytes -= 2 * len(old) + _ENTRY_OVERHEAD
        cache[key] = params
        self._params_cache_bytes += cost

    @property
    def params_cache_bytes(self) -> int:
        """The cache's estimated size (tests, metrics)."""
        return self._params_cache_bytes

    async def tokenize(self, req: router_pb2.GenerateRequest) -> list[int]:
        """The prompt's token ids as a generation would see them (/tokenize)."""
        return (await self._prompt_token_ids(req))[0]

    async def _prompt_token_ids(self, req: router_pb2.GenerateRequest,
                                refuse_long: bool = True) -> tuple[list[int], list[bytes]]:
        """-> (token ids, the chat's images in prompt order; [] for text). refuse_long: refuse a
        text far over the context from a prefix (not when the request truncates its prompt)."""
        which = req.WhichOneof("input")
        if which == "prompt":
            text = req.prompt
            special = req.add_special_tokens if req.HasField("add_special_tokens") else True
            if len(text) > _OFFLOAD_CHARS:
                return await asyncio.to_thread(self._encode_long, text, refuse_long, special), []
            return self.tokenizer.encode(text, add_special_tokens=special), []
        if which == "prompt_token_ids":
            if req.add_special_tokens:
                raise invalid("add_special_tokens", "a prompt of token ids is taken as given: nothing is added to it")
            ids = list(req.prompt_token_ids.ids)
            if not ids:
                raise invalid("prompt_token_ids", "must not be empty")
            if self.max_model_len and len(ids) >= self.max_model_len:
                raise invalid("prompt_token_ids", f"prompt has {len(ids)} tokens; this model's maximum context "
                              f"length is {self.max_model_len}")
            if max(ids) >= self.vocab_size:
                raise invalid("prompt_token_ids", f"token id {max(ids)} is out of range [0, {self.vocab_size})")
            return ids, []
        if which == "chat":
            return await self._render_chat(req.chat, refuse_long, req.add_special_tokens)
        raise invalid("input", "one of prompt, prompt_token_ids or chat is required")

    async def _render_chat(self, chat: router_pb2.ChatMessages, refuse_long: bool = True,
                           add_special_tokens: bool = False) -> tuple[list[int], list[bytes]]:
        if not chat.messages:
            raise invalid("messages", "must not be empty")
        if chat.continue_final_message and chat.add_generation_prompt:
            raise invalid("continue_final_message", "cannot be combined with add_generation_prompt: set "
                          "add_generation_prompt to false to continue the final message")
        if len(chat.messages) > MAX_CHAT_MESSAGES:
            raise invalid("messages", f"at most {MAX_CHAT_MESSAGES} messages")
        messages = []
        images: list[bytes] = []
        for i, m in enumerate(chat.messages):
            if m.role not in CHAT_ROLES:
                raise invalid("messages", f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}, got {m.role!r}")
            msg: dict = {"role": m.role, "content": self._message_content(m, images)}
            if m.HasField("name"):
                msg["name"] = m.name
            if m.HasField("tool_call_id"):
                msg["tool_call_id"] = m.tool_call_id
            if m.HasField("reasoning_content"):
                msg["reasoning_content"] = m.reasoning_content
            if m.tool_calls_json:
                msg["tool_calls"] = self._json_field(m.tool_calls_json, "messages", f"messages[{i}].tool_calls_json")
            messages.append(msg)
        tools = self._json_field(chat.tools_json, "tools", "tools_json") if chat.tools_json else None
        variables = self._template_kwargs(chat.template_kwargs_json) if chat.template_kwargs_json else {}
        try:
            render = functools.partial(self.tokenizer.apply_chat_template, tools=tools,
                                       continue_final_message=chat.continue_final_message,
                                       add_special_tokens=add_special_tokens, **variables)
            chars = sum(len(m["content"]) for m in messages) + len(chat.tools_json)
            if chars > _OFFLOAD_CHARS and refuse_long:  # the messages' text alone may be over the limit: no rendering then
                await asyncio.to_thread(self._refuse_if_too_long, "\n".join(m["content"] for m in messages),
                                        "messages")
            if images or chars > _OFFLOAD_CHARS:
                ids = await asyncio.to_thread(render, messages, chat.add_generation_prompt, True)
            else:
                ids = render(messages, chat.add_generation_prompt, True)
        except (jinja2.TemplateError, ValueError, TypeError) as e:
            # Templates reject shapes they do not support ("roles must alternate", ...).
            if str(e).startswith("continue_final_message"):
                raise invalid("continue_final_message", str(e)) from None
            raise invalid("messages", f"chat template: {e}") from None
        if not ids:
            raise invalid("messages", "the chat template rendered an empty prompt")
        if self.image_placeholders is None:
            return list(ids), images
        check_image_bytes(images, self.image_limits)
        return expand_placeholders(list(ids), len(images), self.image_placeholders), images

    def _message_content(self, m: router_pb2.ChatMessage, images: list[bytes]) -> str | list[dict[str, str]]:
        """A string, or the typed parts transformers' processors give a chat template; images are
        collected in order. A multimodal model whose template reads typed parts gets parts for
        text-only messages too (vLLM's "openai" content format)."""
        if not m.parts:
            return [{"type": "text", "text": m.content}] if self._typed_parts else m.content
        if self.image_placeholders is None:
            raise invalid("messages", "this model takes no images (it is not a multimodal checkpoint)")
        parts: list[dict[str, str]] = []
        for part in m.parts:
            if part.WhichOneof("part") == "image":
                images.append(part.image)
                parts.append({"type": "image"})
            else:
                parts.append({"type": "text", "text": part.text})
        return parts

    def _encode_long(self, text: str, refuse_long: bool = True, add_special_tokens: bool = True) -> list[int]:
        """A long prompt's ids, on a worker thread (the tokenizer holds the GIL while it encodes:
        measured, a 2 MB prompt held the router's loop for 2.2 s); one far over the context length
        is refused from a prefix without encoding the rest (unless it is to be truncated: then all
        of it is encoded, bounded by max_message_bytes)."""
        if refuse_long:
            self._refuse_if_too_long(text, "prompt")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _refuse_if_too_long(self, text: str, field: str) -> None:
        """Encode growing prefixes (x4 each time, cut at whitespace) and refuse as soon as one alone
        has more tokens than the context holds: the work is bounded by about 4x what the limit
        needs, whatever the text's length. A prefix cut mid-word may tokenize into a few more
        tokens than the same characters inside the whole text, hence the margin."""
        limit = self.max_model_len
        if limit is None:
            return
        size = max(_OFFLOAD_CHARS, 8 * limit)
        while size < len(text):
            cut = text.rfind(" ", size - 256, size)
            cut = cut if cut > 0 else size
            count = len(self.tokenizer.encode(text[:cut], add_special_tokens=False))
            if count >= limit + _PREFIX_MARGIN_TOKENS:
                raise invalid(field, f"prompt has more than {count - _PREFIX_MARGIN_TOKENS} tokens (in its first "
                              f"{cut} of {len(text)} characters); this model's maximum context length is {limit}")
            size *= 4

    def _check_logprob_volume(self, prompt_len: int, max_tokens: int, params: SamplingParams, stream: bool) -> None:
        """Logprob values that travel in one message stay within max_message_bytes (at
        LOGPROB_VALUE_BYTES each, a generous size of one serialized entry with its text): the
        prompt's, which come with the first token, and a whole answer's when it is not streamed.
        A streamed answer's come a step at a time."""
        budget = self.max_message_bytes // LOGPROB_VALUE_BYTES
        if params.prompt_logprobs is not None:
            values = (prompt_len - 1) * (params.prompt_logprobs + 1)
            if values > budget:
                raise invalid("prompt_logprobs", f"{prompt_len} prompt tokens x {params.prompt_logprobs + 1} logprobs "
                              f"each are {values} values; at most {budget} fit one answer: ask for fewer "
                              "alternatives or send a shorter prompt")
        if params.logprobs is not None and not stream:
            values = max_tokens * (params.logprobs + 1)
            if values > budget:
                raise invalid("logprobs", f"max_tokens={max_tokens} x {params.logprobs + 1} logprobs each are {values} "
                              f"values; at most {budget} fit one answer that is not streamed: stream it, lower "
                              "max_tokens or ask for fewer alternatives")

    def _check_length(self, prompt_len: int, max_tokens: int) -> None:
        if prompt_len == 0:
            raise invalid("prompt", "the prompt is empty after tokenization")
        limit = self.max_model_len
        if limit is None:
            return
        if prompt_len >= limit:
            raise invalid("prompt", f"prompt has {prompt_len} tokens; this model's maximum context length is {limit}")
        if prompt_len + max_tokens > limit:
            raise invalid("max_tokens", f"max_tokens={max_tokens} + {prompt_len} prompt tokens exceeds this model's "
                          f"maximum context length of {limit}")


def _check_template_kwargs(value: object, reserved: Collection[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise invalid("chat_template_kwargs", "must be a JSON object of template variables")
    if len(value) > MAX_TEMPLATE_KWARGS:
        raise invalid("chat_template_kwargs", f"has {len(value)} variables; at most {MAX_TEMPLATE_KWARGS} allowed")
    for name in value:
        if not name.isidentifier():
            raise invalid("chat_template_kwargs", f"{name[:64]!r} is not a template variable name")
        if name in reserved or name.startswith("_"):
            raise invalid("chat_template_kwargs", f"{name!r} is set by the server, not by chat_template_kwargs")
    return value


def _check_request_id(request_id: str) -> str:
    if len(request_id) > MAX_REQUEST_ID_LEN:
        raise invalid("request_id", f"at most {MAX_REQUEST_ID_LEN} characters")
    if request_id and not (request_id.isascii() and request_id.isprintable()):
        raise invalid("request_id", "must be printable ASCII")
    return request_id
