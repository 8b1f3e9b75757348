"""Synthetic and file datasets: each returns the list of `BenchRequest`s to send, in send order.

Semantics follow vLLM's `--dataset-name random`, `prefix-repetition` and custom JSONL datasets;
the Mooncake trace lives in trace.py because it also carries its own send times.
All randomness comes from `--seed`, so two runs with the same flags send the same prompts.
"""

from __future__ import annotations

import json
import os

import numpy as np

from pdcluster.cluster.bench.prompts import PromptBuilder
from pdcluster.cluster.bench.request import BenchRequest


def _check_positive(**values: int) -> None:
    for name, v in values.items():
        if v < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {v}")


def length_range(mean_len: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive [low, high] of lengths drawn uniformly around `mean_len` (vLLM's range ratio)."""
    return int(mean_len * (1 - range_ratio)), int(mean_len * (1 + range_ratio))


def sample_random(builder: PromptBuilder, num_requests: int, input_len: int, output_len: int,
                  range_ratio: float = 0.0, prefix_len: int = 0, seed: int = 0) -> list[BenchRequest]:
    """Random prompts of `prefix_len` shared tokens plus input_len * U[1 - r, 1 + r] own tokens."""
    _check_positive(random_input_len=input_len, random_output_len=output_len, random_prefix_len=prefix_len)
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    in_low, in_high = length_range(input_len, range_ratio)
    out_low, out_high = length_range(output_len, range_ratio)
    out_low = max(out_low, 1)  # every request generates at least one token
    input_lens = rng.integers(in_low, in_high + 1, size=num_requests)
    output_lens = rng.integers(out_low, max(out_high, out_low) + 1, size=num_requests)
    prefix = builder.random_ids(rng, prefix_len)
    out = []
    for n_in, n_out in zip(input_lens, output_lens):
        text, prompt_len = builder.to_text(prefix + builder.random_ids(rng, int(n_in)), rng)
        out.append(BenchRequest(prompt=text, prompt_len=prompt_len, expected_output_len=int(n_out)))
    return out


def sample_prefix_repetition(builder: PromptBuilder, num_requests: int, prefix_len: int, suffix_len: int,
                             num_prefixes: int, output_len: int, seed: int = 0) -> list[BenchRequest]:
    """`num_prefixes` distinct prefixes, each shared by an equal share of the requests (each with its
    own suffix), shuffled so that requests sharing a prefix are not sent back to back."""
    _check_positive(prefix_repetition_prefix_len=prefix_len, prefix_repetition_suffix_len=suffix_len)
    if num_prefixes < 1:
        raise ValueError(f"--prefix-repetition-num-prefixes must be >= 1, got {num_prefixes}")
    if output_len < 1:
        raise ValueError(f"--prefix-repetition-output-len must be >= 1, got {output_len}")
    rng = np.random.default_rng(seed)
    prefixes = [builder.random_ids(rng, prefix_len) for _ in range(num_prefixes)]
    out = []
    for i in range(num_requests):
        text, prompt_len = builder.to_text(prefixes[i % num_prefixes] + builder.random_ids(rng, suffix_len), rng)
        out.append(BenchRequest(prompt=text, prompt_len=prompt_len, expected_output_len=output_len))
    order = rng.permutation(num_requests)
    return [out[i] for i in order]


def load_jsonl(path: str | os.PathLike, builder: PromptBuilder, num_requests: int | None = None,
               default_output_len: int = 256) -> list[BenchRequest]:
    """Lines of `{"prompt": text or token ids, "output_len": N}`; `output_len` is optional."""
    out: list[BenchRequest] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if num_requests is not None and len(out) >= num_requests:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt = row["prompt"]
                output_len = int(row.get("output_len", default_output_len))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: expected {{\"prompt\": ..., \"output_len\": N}}: {e}") from e
            if isinstance(prompt, str):
                prompt_len = builder.count(prompt)
            elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                prompt_len = len(prompt)
            else:
                raise ValueError(f"{path}:{lineno}: prompt must be a string or a list of token ids")
            if output_len < 1:
                raise ValueError(f"{path}:{lineno}: output_len must be >= 1, got {output_len}")
            out.append(BenchRequest(prompt=prompt, prompt_len=prompt_len, expected_output_len=output_len))
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out
