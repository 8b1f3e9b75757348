"""Load a Hugging Face tokenizer with the `tokenizers` library only.

transformers would cost seconds of import time and a large dependency for what the benchmark
needs: count tokens and turn token ids into text.
"""

from __future__ import annotations

import os
import pathlib

from tokenizers import Tokenizer


def resolve_tokenizer_file(path: str | os.PathLike) -> pathlib.Path:
    """`path` is a local HF model directory holding tokenizer.json, or the tokenizer.json itself."""
    p = pathlib.Path(path).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise FileNotFoundError(
            f"no tokenizer at {p}: --tokenizer (or --model) must be a local HF directory with tokenizer.json")
    return p


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    return Tokenizer.from_file(str(resolve_tokenizer_file(path)))


def special_token_ids(tok: Tokenizer) -> set[int]:
    """Ids of added special tokens (BOS, EOS, chat markers): never put into synthetic prompts."""
    return {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
