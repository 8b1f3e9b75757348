"""vLLM's `bad_words`: words the output must not contain, as token sequences.

A word is tokenized twice, as written (leading spaces stripped) and after a space, because a
byte-level BPE spells " word" mid-sentence with other tokens than "word" at the start. At each
step a sequence bans its last token when the output so far ends with the tokens before it; a
one-token sequence is banned always. Pure Python: the engine tokenizes, the sampler asks
`banned_ids` every step.
"""

from __future__ import annotations

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


def banned_ids(sequences: Sequence[tuple[int, ...]], output: Sequence[int]) -> list[int]:
    """The tokens these sequences forbid as the next token after `output`."""
    out = []
    n = len(output)
    for seq in sequences:
        k = len(seq) - 1
        if k == 0:
            out.append(seq[0])
        elif k <= n and all(output[n - k + j] == seq[j] for j in range(k)):
            out.append(seq[-1])
    return out
