from __future__ import annotations

import json
import pathlib
from collections import Counter

import pytest

from pdcluster.cluster.bench.datasets import length_range, load_jsonl, sample_prefix_repetition, sample_random
from pdcluster.cluster.bench.prompts import PromptBuilder


def _ids(builder: PromptBuilder, text: str) -> list[int]:
    return builder.tokenizer.encode(text, add_special_tokens=False).ids


def test_random_fixed_lengths(builder: PromptBuilder) -> None:
    reqs = sample_random(builder, 8, input_len=40, output_len=6, seed=1)
    assert len(reqs) == 8
    for r in reqs:
        assert r.prompt_len == 40 == len(_ids(builder, r.prompt))
        assert r.expected_output_len == 6


def test_random_range_ratio_bounds(builder: PromptBuilder) -> None:
    assert length_range(100, 0.25) == (75, 125)
    reqs = sample_random(builder, 200, input_len=20, output_len=10, range_ratio=0.5, seed=2)
    assert {r.prompt_len for r in reqs} <= set(range(10, 31))
    assert {r.expected_output_len for r in reqs} <= set(range(5, 16))
    assert len({r.prompt_len for r in reqs}) > 10  # actually spread out


def test_random_prefix_is_shared_at_token_level(builder: PromptBuilder) -> None:
    reqs = sample_random(builder, 5, input_len=10, output_len=4, prefix_len=16, seed=3)
    prefixes = {tuple(_ids(builder, r.prompt)[:16]) for r in reqs}
    assert len(prefixes) == 1
    assert all(r.prompt_len == 26 for r in reqs)
    assert len({r.prompt for r in reqs}) == 5


def test_random_is_seeded(builder: PromptBuilder) -> None:
    a = sample_random(builder, 4, 12, 3, range_ratio=0.3, seed=5)
    assert a == sample_random(builder, 4, 12, 3, range_ratio=0.3, seed=5)
    assert a != sample_random(builder, 4, 12, 3, range_ratio=0.3, seed=6)


def test_random_rejects_bad_flags(builder: PromptBuilder) -> None:
    with pytest.raises(ValueError, match="range-ratio"):
        sample_random(builder, 1, 10, 2, range_ratio=1.0)
    with pytest.raises(ValueError, match="random-input-len"):
        sample_random(builder, 1, -1, 2)


def test_prefix_repetition_groups(builder: PromptBuilder) -> None:
    reqs = sample_prefix_repetition(builder, 10, prefix_len=12, suffix_len=5, num_prefixes=3, output_len=7, seed=1)
    assert len(reqs) == 10
    assert all(r.prompt_len == 17 and r.expected_output_len == 7 for r in reqs)
    groups = Counter(tuple(_ids(builder, r.prompt)[:12]) for r in reqs)
    assert sorted(groups.values()) == [3, 3, 4]
    order = [tuple(_ids(builder, r.prompt)[:12]) for r in reqs]
    assert order != sorted(order, key=list(groups).index)  # shuffled, not grouped


def test_jsonl(tmp_path: pathlib.Path, builder: PromptBuilder) -> None:
    path = tmp_path / "prompts.jsonl"
    lines = [{"prompt": " fox dog", "output_len": 3}, {"prompt": [5, 6, 7, 8]}, {"prompt": " cache", "output_len": 9}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    reqs = load_jsonl(path, builder, default_output_len=11)
    assert [r.expected_output_len for r in reqs] == [3, 11, 9]
    assert reqs[0].prompt_len == len(_ids(builder, " fox dog"))
    assert reqs[1].prompt == [5, 6, 7, 8] and reqs[1].prompt_len == 4
    assert len(load_jsonl(path, builder, num_requests=2)) == 2


@pytest.mark.parametrize("line", ['{"text": "x"}', '{"prompt": 3}', "not json", '{"prompt": "x", "output_len": 0}'])
def test_jsonl_errors_name_the_line(tmp_path: pathlib.Path, builder: PromptBuilder, line: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(ValueError, match=":2:"):
        load_jsonl(path, builder)
