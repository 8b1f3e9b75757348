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
