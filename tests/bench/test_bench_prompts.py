from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pdcluster.cluster.bench import prompts
from pdcluster.cluster.bench.prompts import PromptBuilder


def test_word_pool_round_trips_token_for_token(builder: PromptBuilder) -> None:
    assert builder.exact and len(builder.pool) >= prompts.MIN_POOL
    rng = np.random.default_rng(0)
    for n in (1, 7, 300):
        ids = builder.random_ids(rng, n)
        text, prompt_len = builder.to_text(ids, rng)
        assert prompt_len == n
        assert builder.tokenizer.encode(text, add_special_tokens=False).ids == ids


def test_pool_excludes_special_tokens(builder: PromptBuilder) -> None:
    specials = {builder.tokenizer.token_to_id("<s>"), builder.tokenizer.token_to_id("</s>")}
    assert not specials & set(builder.pool.tolist())


def test_sentencepiece_style_tokenizer_round_trips(corpus: str) -> None:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator([corpus] * 4, trainer=trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    b = PromptBuilder(tok)
    ids = b.random_ids(np.random.default_rng(1), 200)
    assert b.exact and tok.encode(b.decode(ids), add_special_tokens=False).ids == ids


def test_fallback_corrects_the_length(tokenizer_dir: str, monkeypatch) -> None:
    from pdcluster.cluster.bench.tokenizer import load_tokenizer

    monkeypatch.setattr(prompts, "MIN_POOL", 10**9)  # force the all-tokens fallback
    b = PromptBuilder(load_tokenizer(tokenizer_dir))
    assert not b.exact
    rng = np.random.default_rng(2)
    hits = 0
    for _ in range(40):
        target = int(rng.integers(1, 200))
        text, n = b.to_text(b.random_ids(rng, target), rng)
        assert n == b.count(text)
        hits += n == target
    assert hits >= 36  # re-encoding converges almost always (random byte tokens are the worst case)
