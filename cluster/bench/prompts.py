"""Text prompts of an exact token length, with prefixes that stay shared after re-tokenization.

Random token ids do not survive decode -> encode: byte-level BPE merges across neighbours, so a
"1024-token" prompt comes back as 900 tokens and two prompts that share 512 ids may share fewer
tokens once the server tokenizes them. That breaks what the benchmark measures (prompt lengths,
prefix-cache hits). So prompts are built from a pool of whole-word tokens: each decodes to one
whitespace-separated word that tokenizes back to exactly itself, and the pre-tokenizer splits on
whitespace, so any sequence of pool ids round-trips id for id:

    ids [" fox", " dog", " blocks"] -> " fox dog blocks" -> [" fox", " dog", " blocks"]

For tokenizers without such words (rare), every non-special token is used and the length is
corrected by re-encoding a few times, as vLLM does.
"""

from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer

from pdcluster.cluster.bench.tokenizer import special_token_ids

MAX_CANDIDATES = 20_000  # enough words; keeps the pool scan well under a second on a 150k vocab
MIN_POOL = 16
MAX_FIX_ROUNDS = 10


class PromptBuilder:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.pool = self._word_pool()
        self.exact = len(self.pool) >= MIN_POOL
        if not self.exact:
            specials = special_token_ids(tokenizer)
            self.pool = np.array([i for i in range(tokenizer.get_vocab_size()) if i not in specials])
        if len(self.pool) == 0:
            raise ValueError("the tokenizer has no usable tokens to build prompts from")

    def _word_pool(self) -> np.ndarray:
        tok = self.tokenizer
        specials = special_token_ids(tok)
        ids = np.array([i for i in range(tok.get_vocab_size()) if i not in specials])
        if len(ids) > MAX_CANDIDATES:  # a fixed sample: the pool must not depend on --seed
            ids = np.sort(np.random.default_rng(0).choice(ids, MAX_CANDIDATES, replace=False))
        # A token qualifies when three copies decode to three equal words that encode back to it.
        texts = tok.decode_batch([[int(i)] * 3 for i in ids], skip_special_tokens=False)
        encoded = tok.encode_batch(texts, add_special_tokens=False)
        keep = []
        for i, text, enc in zip(ids, texts, encoded):
            words = text.split()
            if len(words) == 3 and words[0] == words[1] == words[2] and words[0].isalpha() \
                    and enc.ids == [i, i, i]:
                keep.append(int(i))
        return np.array(keep, dtype=np.int64)

    def random_ids(self, rng: np.random.Generator, num_tokens: int) -> list[int]:
        if num_tokens <= 0:
            return []
        return self.pool[rng.integers(0, len(self.pool), size=num_tokens)].tolist()

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def to_text(self, ids: list[int], rng: np.random.Generator) -> tuple[str, int]:
        """Text for `ids` and its token count; equal to len(ids) whenever the word pool is used."""
        target = len(ids)
        text = self.decode(ids)
        if self.exact:
            return text, target
        # Fallback: re-encode, then cut or pad in the re-encoded space until the length holds. A cut
        # can end inside a multi-byte character that re-encodes as more tokens, so every further
        # overshoot cuts one token deeper and lets the padding refill.
        deeper = 0
        for _ in range(MAX_FIX_ROUNDS):
            got = self.tokenizer.encode(text, add_special_tokens=False).ids
            if len(got) == target:
                return text, target
            if len(got) > target:
                ids = got[:max(target - deeper, 0)]
                deeper += 1
            else:
                ids = got + self.random_ids(rng, target - len(got))
            text = self.decode(ids)
        return text, self.count(text)
