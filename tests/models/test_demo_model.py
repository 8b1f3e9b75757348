"""The shipped demo model writes sense: its greedy output, through pdcluster's own `LLM`, is mostly
words of a vocabulary it did not train on (idlelib's text files and Python's LICENSE.txt, which
scripts/train_demo_model.py leaves out, plus the held-out split's docstrings), where random tokens
of the same tokenizer are not."""

from __future__ import annotations

import ast
import importlib.util
import json
import pathlib
import random
import re
import sysconfig

import pytest

from pdcluster.engine.llm import LLM
from pdcluster.models import demo
from pdcluster.sampling_params import SamplingParams

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROMPTS = ["The prefill pool", "def ", "Return the", "This module provides"]
WORD = re.compile(r"[A-Za-z]{2,}")
THRESHOLD = 0.7  # fraction of the output's words found in the unseen vocabulary


def _trainer():
    spec = importlib.util.spec_from_file_location("train_demo_model", ROOT / "scripts" / "train_demo_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def unseen_vocabulary() -> set[str]:
    words = _unseen_words()
    if len(words) < 3000:
        pytest.skip(f"only {len(words)} unseen words on this Python install")
    return words


def _unseen_words() -> set[str]:
    base = pathlib.Path(sysconfig.get_paths()["stdlib"])
    texts = [p.read_text(errors="replace") for p in sorted((base / "idlelib").glob("*.txt"))]
    texts += [p.read_text(errors="replace") for p in [base / "LICENSE.txt"] if p.exists()]
    trainer = _trainer()
    for i, path in enumerate(trainer.stdlib_files()):
        if i % trainer.HELDOUT_EVERY == 3:  # the held-out split of build_corpus
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            texts += [ast.get_docstring(n) or "" for n in ast.walk(tree)
                      if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)]
    return {w.lower() for t in texts for w in WORD.findall(t)}


def _real_word_fraction(text: str, vocabulary: set[str]) -> float:
    words = WORD.findall(text)
    return sum(w.lower() in vocabulary for w in words) / max(1, len(words))


@pytest.fixture(scope="module")
def demo_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return demo.ensure_demo_model(tmp_path_factory.mktemp("demo") / "model")


def test_shipped_checkpoint_is_small_and_has_the_demo_shape(demo_path: str) -> None:
    size = sum(f.stat().st_size for f in demo.CHECKPOINT_DIR.iterdir() if f.is_file())
    assert size <= 30 * 2**20, f"demo checkpoint is {size / 2**20:.1f} MiB"
    config = json.loads((pathlib.Path(demo_path) / "config.json").read_text())
    assert {k: config[k] for k in demo.DEMO_CONFIG} == demo.DEMO_CONFIG
    assert json.loads((pathlib.Path(demo_path) / "tokenizer_config.json").read_text())["chat_template"]


@pytest.mark.timeout(120)
def test_greedy_output_is_mostly_words_it_did_not_train_on(demo_path: str, unseen_vocabulary: set[str]) -> None:
    llm = LLM(demo_path, max_model_len=256)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=48))
    texts = [o.outputs[0].text for o in outs]
    fractions = [_real_word_fraction(t, unseen_vocabulary) for t in texts]
    report = "\n".join(f"{f:.2f} {p!r} -> {t!r}" for f, p, t in zip(fractions, PROMPTS, texts))
    assert all(len(WORD.findall(t)) >= 8 for t in texts), report
    assert sum(fractions) / len(fractions) >= THRESHOLD and min(fractions) >= THRESHOLD - 0.15, report
    # The check tells sense from noise: random tokens of the same tokenizer fail it.
    tok = llm.get_tokenizer()
    rng = random.Random(0)
    noise = [tok.decode([rng.randrange(len(demo.SPECIAL_TOKENS), 4096) for _ in range(48)]) for _ in PROMPTS]
    assert sum(_real_word_fraction(t, unseen_vocabulary) for t in noise) / len(noise) < THRESHOLD - 0.15
