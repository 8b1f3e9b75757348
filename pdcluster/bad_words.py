"""vLLM's `bad_words`: words the output must not contain, as token sequences.

A word is tokenized twice, as written (leading spaces stripped) and after a space, because a
byte-level BPE spells " word" mid-sentence with other tokens than "word" at the start. At each
step a sequence bans its last token when the output so far ends with the tokens before it; a
one-token sequence is banned always. Pure Python: the engine tokenizes, the sampler asks
`banned_ids` every step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

Encode = Callable[[str], list[int]]  # text -> token ids, no special tokens


def tokenize_bad_words(words: Sequence[str], encode: Encode) -> tuple[tuple[int, ...], ...]:
    """Each word's token sequences, as written and after a space; duplicates once."""
    seen: dict[tuple[int, ...], None] = {}
    for word in words:
        bare = word.lstrip()
        for text in (bare, " " + bare):
            ids = tuple(encode(text))
            if ids:
                seen.setdefault(ids, None)
    return tuple(seen)


def banned_ids(sequences: tuple[tuple[int, ...], ...], output: Sequence[int]) -> list[int]:
    """The tokens these sequences forbid as the next token after `output`: one dictionary lookup
    per distinct sequence length, whatever the number of words (asked every step, every row)."""
    always, by_length = _index(sequences)
    out = list(always)
    n = len(output)
    for k, last_of in by_length:
        if k <= n:
            out.extend(last_of.get(tuple(output[n - k:]), ()))
    return out


@functools.lru_cache(maxsize=1024)
def _index(sequences: tuple[tuple[int, ...], ...]
           ) -> tuple[tuple[int, ...], tuple[tuple[int, dict[tuple[int, ...], list[int]]], ...]]:
    """(one-token words, [(prefix length k, {the k tokens before: last tokens})]), built once per
    distinct set of sequences (SamplingParams holds them as a hashable tuple)."""
    always = tuple(dict.fromkeys(s[0] for s in sequences if len(s) == 1))
    by_length: dict[int, dict[tuple[int, ...], list[int]]] = {}
    for s in sequences:
        if len(s) > 1:
            by_length.setdefault(len(s) - 1, {}).setdefault(s[:-1], []).append(s[-1])
    return always, tuple(sorted(by_length.items()))
