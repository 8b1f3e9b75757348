"""Turns a user prompt into validated token ids. Every rejection is a ValueError naming the field
and the limit (services map it to INVALID_ARGUMENT); nothing here touches engine state, so a bad
request can never disturb the others."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pdcluster.sampling_params import SamplingParams, truncated

if TYPE_CHECKING:
    from pdcluster.engine.tokenizer import Tokenizer

MAX_REQUEST_ID_LEN = 256


def validate_request_id(request_id: object) -> str:
    if not isinstance(request_id, str) or not request_id:
        raise ValueError("request_id must be a non-empty string")
    if len(request_id) > MAX_REQUEST_ID_LEN:
        raise ValueError(f"request_id is {len(request_id)} characters; at most {MAX_REQUEST_ID_LEN} allowed")
    return request_id


def process_prompt(
    prompt: str | Sequence[int],
    params: SamplingParams,
    tokenizer: Tokenizer | None,
    vocab_size: int,
    max_model_len: int,
) -> tuple[str | None, list[int]]:
    """Return (prompt_text or None, prompt_token_ids) or raise ValueError."""
    if not isinstance(params, SamplingParams):
        raise ValueError("sampling_params must be a SamplingParams")
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty")
        if tokenizer is None:
            raise ValueError("prompt: text prompts need a tokenizer; pass token ids instead")
        text: str | None = prompt
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
        text = None
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt_token_ids must not be empty")
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int):
                raise ValueError(f"prompt_token_ids[{i}] must be an integer, got {type(t).__name__}")
            if not 0 <= t < vocab_size:
                raise ValueError(f"prompt_token_ids[{i}] = {t} is outside the vocabulary [0, {vocab_size})")
    else:
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    if not ids:
        raise ValueError("prompt must not be empty (it tokenized to no tokens)")
    ids = truncated(ids, params.truncate_prompt_tokens, max_model_len, params.max_tokens)
    # At least one position must remain for a generated token.
    if len(ids) >= max_model_len:
        raise ValueError(
            f"prompt is {len(ids)} tokens; it must be shorter than max_model_len={max_model_len}")
    return text, ids


def resolve_token_masks(params: SamplingParams, tokenizer: Tokenizer | None, vocab_size: int,
                        eos_token_ids: Sequence[int]) -> SamplingParams:
    """allowed_token_ids checked against the vocabulary, bad_words tokenized into
    bad_words_token_ids, and the requests that could only ever sample from nothing refused."""
    allowed = params.allowed_token_ids
    if allowed and allowed[-1] >= vocab_size:
        raise ValueError(f"allowed_token_ids: token id {allowed[-1]} is outside the vocabulary [0, {vocab_size})")
    if params.bad_words:
        if tokenizer is None:
            raise ValueError("bad_words: this engine has no tokenizer to spell them with")
        from pdcluster.bad_words import tokenize_bad_words

        seqs = tokenize_bad_words(params.bad_words, lambda text: tokenizer.encode(text, add_special_tokens=False))
        params = params.replace(bad_words_token_ids=[list(s) for s in seqs])
    elif params.bad_words_token_ids:
        params = params.replace(bad_words_token_ids=[])  # derived here only, never taken as given
    if allowed:
        always_banned = {s[0] for s in params.bad_words_token_ids if len(s) == 1}
        if set(allowed) <= always_banned:
            raise ValueError("allowed_token_ids: every allowed token is a bad_words token")
        if params.min_tokens:
            until_min = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
            if set(allowed) <= until_min:
                raise ValueError("allowed_token_ids: every allowed token is a stop token, which min_tokens forbids")
    return params
