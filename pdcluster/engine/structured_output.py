"""Structured output with xgrammar: grammars compiled once per spec, a matcher per request.

    GrammarCompilerCache.compile(spec)  -> CompiledGrammar  (bounded LRU keyed by (kind, spec text);
                                           ValueError naming structured_outputs.<kind> when xgrammar
                                           cannot compile it)
    GrammarState(compiled, stop ids)    -> per request: fill its row of the step's token bitmask,
                                           advance with each sampled token

The sampler fills one (B, ceil(V/32)) int32 bitmask for every constrained row of a step and applies
it batched (xgrammar's apply_token_bitmask_inplace) before any sampling stage, so greedy, random,
penalties and top-k/p all see only the tokens the grammar allows. The grammar ends at one of the
request's stop tokens (its eos ids and stop_token_ids): once complete only those are allowed, and
sampling one stops the request through the scheduler's usual eos/stop-token check.

A matcher is built from the request's output tokens so far (advanced over them), so a decode leg
continues the grammar after the prefill leg's token and a preempted request resumes where it was.
xgrammar (and torch) are imported only here: the router never imports this module.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from typing import Any

import torch
import xgrammar as xgr

from pdcluster.structured_spec import StructuredOutputs

logger = logging.getLogger(__name__)

DEFAULT_MAX_CACHED_GRAMMARS = 128
# xgrammar's messages start with "[time] /path/file.cc:line: ": the client needs only the rest.
_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


def tokenizer_info(backend: Any, vocab_size: int, stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of a `tokenizers` backend: every id's token string and the decoder's
    vocabulary type (byte-level, byte-fallback or raw), as xgrammar's from_huggingface detects it."""
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    vocab = [backend.id_to_token(i) or "" for i in range(vocab_size)]
    return xgr.TokenizerInfo(vocab, vocab_type=meta["vocab_type"], vocab_size=vocab_size,
                             stop_token_ids=stop_token_ids or None, add_prefix_space=meta["add_prefix_space"])


class GrammarCompilerCache:
    """One per engine (and per TP rank): compiles each (kind, spec) once, keeps the most recent."""

    def __init__(self, info: xgr.TokenizerInfo, max_entries: int = DEFAULT_MAX_CACHED_GRAMMARS) -> None:
        # xgrammar's own cache is unbounded: ours is bounded by entries.
        self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._max = max_entries
        # Requests are validated (compiled) on the caller's thread while the engine thread builds
        # matchers: the dict is guarded; a compile runs outside the lock (xgrammar is thread-safe).
        self._lock = threading.Lock()
        self.vocab_size = info.vocab_size

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> GrammarCompilerCache:
        return cls(tokenizer_info(tokenizer.backend, vocab_size, stop_token_ids))

    def compile(self, spec: StructuredOutputs) -> xgr.CompiledGrammar:
        key = spec.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiled = self._compile(spec)
        _check_startable(compiled, spec.kind)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self._max:
                self._cache.popitem(last=False)
        return compiled

    def __len__(self) -> int:
        return len(self._cache)

    def _compile(self, spec: StructuredOutputs) -> xgr.CompiledGrammar:
        kind = spec.kind
        try:
            if kind == "json":
                return self._compiler.compile_json_schema(spec.json or "", any_whitespace=False)
            if kind == "json_object":
                # OpenAI's json_object is an object; xgrammar's built-in JSON grammar is any value.
                return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return self._compiler.compile_regex(spec.regex or "")
            if kind == "choice":
                alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice or ())
                return self._compiler.compile_grammar(f"root ::= {alternatives}")
            return self._compiler.compile_grammar(spec.grammar or "")
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar raises RuntimeError on bad specs
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            first = _LOG_PREFIX.sub("", first)
            raise ValueError(f"structured_outputs.{kind} cannot be compiled: {first[:300]}") from None


def _check_startable(compiled: xgr.CompiledGrammar, kind: str) -> None:
    """Refuse a grammar no token of this vocabulary can begin (a word-level vocabulary cannot
    spell `{`, say): every row would be masked to nothing, and the first token sampled from an
    all-masked row would be refused. Once per compiled spec (the cache keeps it)."""
    bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
    if not bool(bitmask.any()):
        raise ValueError(f"structured_outputs.{kind}: no token of this model's vocabulary can begin it")


class GrammarState:
    """One request's matcher. `rejected` is set when a token the grammar refuses was forced on it
    (only a prior output from elsewhere can be: the sampler never picks a masked token, and a row
    its masks leave empty fails its request, sampler.py); the request then runs unconstrained."""

    def __init__(self, compiled: xgr.CompiledGrammar, stop_token_ids: list[int],
                 output_token_ids: list[int] | tuple[int, ...] = ()) -> None:
        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids or None)
        self.rejected = False
        self.advance(output_token_ids)

    def advance(self, token_ids: list[int] | tuple[int, ...]) -> None:
        for t in token_ids:
            if self.rejected or self._matcher.is_terminated():
                return
            if not self._matcher.accept_token(int(t)):
                # Only a token the mask did not allow gets here (a prior output from elsewhere
                # that does not match the grammar): said aloud, never silently.
                logger.warning("structured output: token %d does not match the grammar; the rest of the "
                               "request is unconstrained", int(t))
                self.rejected = True

    @property
    def active(self) -> bool:
        """Whether the grammar still constrains the next token."""
        return not self.rejected and not self._matcher.is_terminated()

    @property
    def terminated(self) -> bool:
        return self._matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def try_accept(self, token_ids: list[int] | tuple[int, ...]) -> int:
        """Accept draft tokens for as long as the grammar allows them; how many it took. Unlike
        advance, a refusal is expected (a draft is a guess) and changes nothing: the caller
        rolls the accepted ones back with rollback once the step's masks are filled."""
        taken = 0
        for t in token_ids:
            if not self.active or not self._matcher.accept_token(int(t)):
                break
            taken += 1
        return taken

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)


def apply_grammar_masks(logits: torch.Tensor, grammars: list[GrammarState | None],
                        drafts_before: list[list[int]] | None = None) -> list[int]:
    """Mask, in place, every token row i's grammar forbids (logits (B, V), any device). One
    bitmask for the batch, filled on CPU, applied in one call. Returns the rows it masked.

    drafts_before[i]: the draft tokens row i comes after (speculative decoding: the rows of one
    request share its matcher and come in order, row j after its first j drafts). Each row is
    masked in the matcher's state after its drafts; the drafts are accepted for the fill and
    rolled back afterwards. A row after a draft the grammar refuses is left unmasked: it can never
    be kept, since the row that checks that draft samples under a mask without it."""
    vocab_size = logits.shape[1]
    bitmask = None
    rows: list[int] = []
    taken: dict[int, tuple[GrammarState, int, bool]] = {}  # id -> (matcher, drafts taken, one refused)
    try:
        for i, g in enumerate(grammars):
            if g is None:
                continue
            before = drafts_before[i] if drafts_before is not None else []
            _, n, refused = taken.get(id(g), (g, 0, False))
            if len(before) < n:
                raise ValueError(f"grammar row {i}: its {len(before)} drafts come before the {n} already taken")
            if not refused and len(before) > n:
                more = g.try_accept(before[n:])
                refused, n = more < len(before) - n, n + more
            taken[id(g)] = (g, n, refused)
            if refused or not g.active:
                continue
            if bitmask is None:
                bitmask = xgr.allocate_token_bitmask(len(grammars), vocab_size)
            g.fill(bitmask, i)
            rows.append(i)
    finally:  # every matcher back where the step found it, whatever happened
        for g, n, _ in taken.values():
            g.rollback(n)
    if bitmask is None:
        return []
    if logits.device.type == "cpu":
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size, indices=rows)
    else:
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                        vocab_size=vocab_size, indices=rows)
    return rows


def build_state(cache: GrammarCompilerCache, spec: StructuredOutputs, eos_token_ids: tuple[int, ...],
                stop_token_ids: tuple[int, ...], output_token_ids: list[int]) -> GrammarState:
    stops = list(dict.fromkeys([*eos_token_ids, *stop_token_ids]))
    return GrammarState(cache.compile(spec), stops, output_token_ids)
