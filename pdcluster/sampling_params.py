"""SamplingParams: the per-request generation controls, validated at construction.

Field names and defaults follow vLLM's `SamplingParams`, which users already know.
Every invalid value raises ValueError naming the field and the limit; services map it to
INVALID_ARGUMENT.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from pdcluster.structured_spec import StructuredOutputs

MAX_LOGPROBS = 20
# Sequences per prompt (`n`): LLM.generate and the HTTP frontend fan them out as one engine
# request each (siblings share the prompt's cached blocks); one engine request is one sequence.
MAX_N = 16
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_LEN = 1024
# Every engine step scans a request's stop ids: 64 is the default bound a server applies
# (router --max-stop-token-ids); the hard ceiling is what any engine accepts at all.
DEFAULT_MAX_STOP_TOKEN_IDS = 64
MAX_STOP_TOKEN_IDS = 1024
MAX_SEED = 2**63 - 1
# logit_bias is added to every step's logits: bounded like stop_token_ids; OpenAI's value range.
MAX_LOGIT_BIAS = 1024
MAX_LOGIT_BIAS_VALUE = 100.0
# A tenant's id or a random token: long enough for either, short enough to hash per request.
MAX_CACHE_SALT_CHARS = 256
MAX_TRUNCATE_PROMPT_TOKENS = 2**31 - 1
# allowed_token_ids masks every other logit each step (O(vocab) per row): enough for any choice
# among words or labels, bounded like the other per-step lists.
MAX_ALLOWED_TOKEN_IDS = 4096
# bad_words are tokenized once per request (each word with and without a leading space) and
# matched against the output's tail every step.
MAX_BAD_WORDS = 64
MAX_BAD_WORD_CHARS = 256
MAX_BAD_WORD_TOKENS = 4 * MAX_BAD_WORD_CHARS + 1  # byte-level BPE: at worst a token per byte, plus the space
MIN_PRIORITY, MAX_PRIORITY = -(2**31), 2**31 - 1  # the wire's int32


@dataclass(frozen=True, init=False)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1, normalised to 0) disables top-k
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return besides the sampled token
    # Logprob of every prompt token after the first (and the top-n alternatives at each position),
    # computed by the prefill; such a prompt never reads the prefix cache (its positions would
    # have no logits).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    # Constrained decoding (json schema, regex, choice, grammar, json_object); see structured_spec.py.
    structured_outputs: StructuredOutputs | None = None
    # (token id, bias) pairs added to the logits every step, sorted by id (a dict is accepted).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Prefix-cache isolation (vLLM's `cache_salt`, which vLLM takes beside the prompt): the salt
    # keys the prompt's first KV block, so the chained hash of every block differs and only
    # requests with the same salt share cached KV, here, in the KV store and in the router's
    # prefix index. Tenants that must not learn from each other's cache hits (TTFT) get
    # different salts. Encoder outputs are not salted.
    cache_salt: str | None = None
    # vLLM's left truncation: keep only the prompt's last k tokens (-1: as many as the context
    # holds beside max_tokens). None: a prompt too long for the context is refused.
    truncate_prompt_tokens: int | None = None
    # vLLM's allowed_token_ids: only these tokens may be sampled (sorted, unique); () = any.
    allowed_token_ids: tuple[int, ...] = ()
    # vLLM's bad_words: a word's last token is banned whenever the output so far ends with the
    # tokens before it (a one-token word is banned always). The engine tokenizes the words, each
    # as written and with a leading space, into bad_words_token_ids (bad_words.py); a value given
    # for that field is replaced there, and it never travels on the wire.
    bad_words: tuple[str, ...] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # vLLM's request priority (lower is served first) under --scheduling-policy priority; an
    # fcfs engine refuses any other value than 0. It rides with the sampling parameters so that
    # every leg, migration and TP rank of a request sees it.
    priority: int = 0
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __init__(self, **kwargs: Any) -> None:
        names = {f.name for f in dataclasses.fields(self)} - {"extra"}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"SamplingParams: unknown field(s) {unknown}; known fields: {sorted(names)}")
        for f in dataclasses.fields(self):
            if f.name == "extra":
                value: Any = {}
            elif f.name in kwargs:
                value = kwargs[f.name]
            else:
                value = f.default
            object.__setattr__(self, f.name, value)
        self._normalise_and_validate()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        return cls(**{k: v for k, v in d.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (lists instead of tuples) for msgpack/protobuf transport."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        out["stop"] = list(self.stop)
        out["stop_token_ids"] = list(self.stop_token_ids)
        # Lists, not maps: msgpack transport (step_codec) refuses non-string map keys.
        out["logit_bias"] = [[t, b] for t, b in self.logit_bias]
        out["structured_outputs"] = self.structured_outputs.to_dict() if self.structured_outputs else None
        out["allowed_token_ids"] = list(self.allowed_token_ids)
        out["bad_words"] = list(self.bad_words)
        out["bad_words_token_ids"] = [list(ids) for ids in self.bad_words_token_ids]
        return out

    def replace(self, **changes: Any) -> SamplingParams:
        d = self.to_dict()
        d.update(changes)
        return SamplingParams(**d)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    # -- validation ---------------------------------------------------------------------------
    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    def _normalise_and_validate(self) -> None:
        def num(name: str, kinds: tuple[type, ...] = (int, float)) -> Any:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, kinds):
                raise ValueError(f"{name} must be a number, got {type(v).__name__}")
            if isinstance(v, float) and v != v:
                raise ValueError(f"{name} must not be NaN")
            return v

        def integer(name: str) -> int:
            return num(name, (int,))

        if not 1 <= integer("n") <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        if not 0.0 <= num("temperature") <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < num("top_p") <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        top_k = integer("top_k")
        if top_k == -1:
            self._set("top_k", 0)
        elif top_k < 0:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {top_k}")
        if not 0.0 <= num("min_p") <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not 0 <= integer("seed") <= MAX_SEED:
            raise ValueError(f"seed must be in [0, 2**63 - 1], got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= num(name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < num("repetition_penalty") <= 10.0:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        if integer("max_tokens") < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0 <= integer("min_tokens") <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and not 0 <= integer(name) <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {getattr(self, name)}")
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if isinstance(stop, (list, tuple)) and len(stop) > MAX_STOP_STRINGS:  # before scanning them
            raise ValueError(f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} allowed")
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise ValueError("stop must be a string or a list of strings")
        if any(not s or len(s) > MAX_STOP_STRING_LEN for s in stop):
            raise ValueError(f"stop strings must be non-empty and at most {MAX_STOP_STRING_LEN} characters")
        self._set("stop", tuple(stop))
        self._set("stop_token_ids", _token_id_list("stop_token_ids", self.stop_token_ids, MAX_STOP_TOKEN_IDS))
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean")
        self._set("logit_bias", _logit_bias(self.logit_bias))
        _check_cache_salt(self.cache_salt)
        k = self.truncate_prompt_tokens
        if k is not None and not (integer("truncate_prompt_tokens") == -1 or 1 <= k <= MAX_TRUNCATE_PROMPT_TOKENS):
            raise ValueError(f"truncate_prompt_tokens must be -1 or in [1, {MAX_TRUNCATE_PROMPT_TOKENS}], got {k}")
        if not MIN_PRIORITY <= integer("priority") <= MAX_PRIORITY:
            raise ValueError(f"priority must be in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {self.priority}")
        self._set("allowed_token_ids", _allowed_token_ids(self.allowed_token_ids))
        self._set("bad_words", _bad_words(self.bad_words))
        self._set("bad_words_token_ids", _bad_words_token_ids(self.bad_words_token_ids))
        self._set("structured_outputs", StructuredOutputs.coerce(self.structured_outputs))
        if self.structured_outputs is not None:
            # The grammar ends at a stop token (eos or stop_token_ids): ignoring eos or banning
            # it (min_tokens) could leave a finished grammar with no token to sample.
            if self.ignore_eos:
                raise ValueError("ignore_eos cannot be combined with structured_outputs")
            if self.min_tokens:
                raise ValueError("min_tokens cannot be combined with structured_outputs")
            # The grammar may need the very token these forbid, leaving nothing to sample.
            for name in ("allowed_token_ids", "bad_words"):
                if getattr(self, name):
                    raise ValueError(f"{name} cannot be combined with structured_outputs")


def sibling_seed(seed: int, j: int) -> int:
    """Sequence j's seed when one request asks for n: seed + j, wrapping, so the sequences differ
    and each is reproducible (LLM.generate and the HTTP fan-out agree on it)."""
    return (seed + j) % (MAX_SEED + 1)


def truncated(ids: list[int], k: int | None, max_model_len: int | None, max_tokens: int) -> list[int]:
    """The prompt ids that truncate_prompt_tokens=k keeps: the last k; -1: the last
    max_model_len - max_tokens (at least 1), so the answer fits; unknown max_model_len: all."""
    if k is None:
        return ids
    keep = (max(1, max_model_len - max_tokens) if max_model_len else len(ids)) if k == -1 else k
    return ids[-keep:] if len(ids) > keep else ids


def _check_text(name: str, text: str, limit: int, what: str = "characters") -> None:
    """A request string that is hashed or tokenized: at most `limit` long, and encodable (an
    unpaired surrogate from a JSON escape has no UTF-8 form)."""
    if len(text) > limit:
        raise ValueError(f"{name} has {len(text)} {what}; at most {limit} allowed")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{name} must be valid Unicode (no unpaired surrogates)") from None


def _check_cache_salt(salt: Any) -> None:
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise ValueError("cache_salt must be a non-empty string")
    _check_text("cache_salt", salt, MAX_CACHE_SALT_CHARS)


def _token_id_list(name: str, value: Any, limit: int) -> tuple[int, ...]:
    """stop_token_ids, allowed_token_ids, each bad word's ids: counted before they are scanned."""
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list of non-negative integers")
    if len(value) > limit:
        raise ValueError(f"{name} has {len(value)} ids; at most {limit} allowed")
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"{name} must be a list of non-negative integers, got {t!r}")
    return tuple(value)


def _allowed_token_ids(value: Any) -> tuple[int, ...]:
    return tuple(sorted(set(_token_id_list("allowed_token_ids", value, MAX_ALLOWED_TOKEN_IDS))))


def _bad_words(value: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)):
        raise ValueError("bad_words must be a list of strings")
    if len(value) > MAX_BAD_WORDS:
        raise ValueError(f"bad_words has {len(value)} words; at most {MAX_BAD_WORDS} allowed")
    for w in value:
        if not isinstance(w, str) or not w.strip():
            raise ValueError("bad_words must be non-empty strings")
        _check_text("bad_words", w, MAX_BAD_WORD_CHARS, "characters in a word")
    return tuple(value)


def _bad_words_token_ids(value: Any) -> tuple[tuple[int, ...], ...]:
    if not isinstance(value, (list, tuple)) or len(value) > 2 * MAX_BAD_WORDS:
        raise ValueError(f"bad_words_token_ids must be a list of at most {2 * MAX_BAD_WORDS} token id lists")
    out = tuple(_token_id_list("bad_words_token_ids", ids, MAX_BAD_WORD_TOKENS) for ids in value)
    if any(not ids for ids in out):
        raise ValueError("bad_words_token_ids must not hold an empty list")
    return out


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    pairs = list(value.items()) if isinstance(value, dict) else value
    if not isinstance(pairs, (list, tuple)):
        raise ValueError("logit_bias must be a map of token id to bias")
    if len(pairs) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias has {len(pairs)} entries; at most {MAX_LOGIT_BIAS} allowed")
    out: dict[int, float] = {}
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ValueError("logit_bias must be a map of token id to bias")
        t, b = pair
        if isinstance(t, str) and t.isdigit():
            t = int(t)  # JSON object keys are strings
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"logit_bias keys must be non-negative token ids, got {t!r}")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -MAX_LOGIT_BIAS_VALUE <= b <= MAX_LOGIT_BIAS_VALUE:
            raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {b!r} for token {t}")
        out[t] = float(b)
    return tuple(sorted(out.items()))
