from __future__ import annotations

import random
from typing import Any

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from pdcluster.engine.detokenizer import IncrementalDetokenizer
from pdcluster.engine.tokenizer import Tokenizer

ALPHABET = list("abcdefgh xyz,.!?\n") + list("éüçñ") + list("你好世界天气") + ["😀", "🎉", "👍🏽", "🇫🇷", "∑"]
CORPUS = ["hello world, this is text. 你好世界! café ñandú 😀🎉 ok", "abc def ghi\nxyz 天气 ∑"] * 20


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    """Byte-level BPE small enough that emoji and CJK split across several tokens."""
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|eos|>", "<|im_start|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(CORPUS, trainer)
    return Tokenizer(backend, {"eos_token": "<|eos|>"})


def stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random) -> list[str]:
    deltas, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        deltas.append(detok.add(ids[i:i + n]))
        i += n
    return deltas


def test_stream_of_random_text_never_breaks_characters(tok: Tokenizer) -> None:
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 25)))
        prompt = tok.encode("".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 6))))
        ids = tok.encode(text)
        detok = IncrementalDetokenizer(tok, prompt)
        deltas = stream(detok, ids, rng)
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) == detok.output_text
        assert "".join(deltas) + detok.finish() == tok.decode(ids) == text
        assert detok.output_token_ids == ids


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_stream_of_random_ids_adds_up_to_decode(tok: Tokenizer, skip_special_tokens: bool) -> None:
    """Arbitrary ids (possibly invalid UTF-8, special tokens, a prompt cut mid-character)."""
    rng = random.Random(1)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 30))]
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 8))]
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens)
        text = "".join(stream(detok, ids, rng)) + detok.finish()
        assert text == tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_partial_character_is_held_back(tok: Tokenizer) -> None:
    ids = tok.encode("a🚀")  # not in the training corpus: its 4 UTF-8 bytes span several tokens
    assert len(ids) >= 3 and all("\ufffd" in tok.decode([i]) for i in ids[1:])
    detok = IncrementalDetokenizer(tok, [])
    assert [detok.add([i]) for i in ids] == ["a"] + [""] * (len(ids) - 2) + ["🚀"]


def test_finish_flushes_an_incomplete_character(tok: Tokenizer) -> None:
    ids = tok.encode("🚀")
    assert len(ids) >= 2
    detok = IncrementalDetokenizer(tok, [])
    assert detok.add(ids[:-1]) == ""
    assert detok.num_held_back_ids == len(ids) - 1
    assert detok.finish() == tok.decode(ids[:-1])  # U+FFFD, exactly as a whole decode gives
    assert detok.finish() == ""


def test_special_tokens(tok: Tokenizer) -> None:
    eos = tok.eos_token_id
    ids = [*tok.encode("hi"), eos]
    skip = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    keep = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    assert skip.add(ids) + skip.finish() == "hi"
    assert keep.add(ids) + keep.finish() == "hi<|eos|>"


class _CountingBackend:
    def __init__(self, backend: BackendTokenizer) -> None:
        self.backend = backend
        self.max_ids = 0
        self.calls = 0

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.calls += 1
        self.max_ids = max(self.max_ids, len(ids))
        return self.backend.decode(ids, **kwargs)


def test_work_per_token_is_constant(tok: Tokenizer) -> None:
    counting = _CountingBackend(tok.backend)
    wrapped = Tokenizer.__new__(Tokenizer)
    wrapped.backend = counting  # type: ignore[assignment]
    ids = tok.encode("hello world 你好世界 😀🎉 " * 40)
    detok = IncrementalDetokenizer(wrapped, tok.encode("prompt text here"))
    for i in ids:
        detok.add([i])
    assert detok.output_text + detok.finish() == tok.decode(ids)
    assert counting.max_ids <= 12  # a short window, never the whole output
    assert counting.calls <= 2 * len(ids) + 2


def test_prompt_context_keeps_the_leading_space_of_sentencepiece_tokens() -> None:
    """Metaspace decoders strip the first token's leading space; after a prompt it is real text."""
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    backend.decoder = decoders.Metaspace(prepend_scheme="first")
    backend.normalizer = None
    trainer = trainers.BpeTrainer(vocab_size=80, show_progress=False)
    backend.train_from_iterator(["hello world again and again"] * 5, trainer)
    sp = Tokenizer(backend)
    prompt, output = sp.encode("hello"), sp.encode("hello world")[len(sp.encode("hello")):]
    assert sp.decode(output) == "world"
    detok = IncrementalDetokenizer(sp, prompt)
    assert detok.add(output) + detok.finish() == " world"
