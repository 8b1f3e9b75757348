"""A tiny random checkpoint with a byte-level BPE tokenizer (one token per byte, GPT-2 style), so
any text, JSON included, can be written by it: structured-output tests need a vocabulary that can
spell `{"a": 1}` (the word-level tiny tokenizer cannot)."""

from __future__ import annotations

import json
import os

from tests.tiny_models import make_tiny_checkpoint

SPECIALS = ["<unk>", "<s>", "</s>"]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")


def write_bytelevel_tokenizer(path: str | os.PathLike, vocab_size: int) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    # Fill the model's vocabulary: ids past the bytes are never-useful special tokens.
    extra = [f"<extra_{i}>" for i in range(len(vocab), vocab_size)]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in extra])
    tok.save(os.path.join(str(path), "tokenizer.json"))
    with open(os.path.join(str(path), "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>",
                   "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}, f)


def make_bytelevel_checkpoint(path: str | os.PathLike, arch: str = "llama", seed: int = 0) -> str:
    """The tiny `arch` model (vocab 384, bos 1, eos 2) with the byte-level tokenizer."""
    out = make_tiny_checkpoint(arch, path, seed=seed)
    write_bytelevel_tokenizer(out, 384)
    return out
