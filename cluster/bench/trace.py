"""Mooncake trace replay: read the trace, build prompts whose shared blocks share tokens.

Format (one JSON object per line, as published with Mooncake):

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48, ...]}

`timestamp` is the arrival in ms; `hash_ids[i]` names prompt block i (BLOCK_SIZE tokens). Two
requests that list the same hash id share that block's content, which is what makes the trace a
prefix-caching workload. Each hash id therefore maps to one fixed block of token ids, drawn from
(--seed, hash id) alone so the mapping does not depend on which request sees the block first:

    hash_ids [7, 9, 12], input_length 1300 ->  block(7)[:512] + block(9)[:512] + block(12)[:276]
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from pdcluster.cluster.bench.prompts import PromptBuilder
from pdcluster.cluster.bench.request import BenchRequest

BLOCK_SIZE = 512  # tokens per hash id in the Mooncake traces


@dataclass(frozen=True)
class TraceRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_trace(path: str | os.PathLike, num_requests: int | None = None) -> list[TraceRecord]:
    """The first `num_requests` records (all when None), ordered by timestamp."""
    records: list[TraceRecord] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if num_requests is not None and len(records) >= num_requests:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                rec = TraceRecord(timestamp_ms=float(row["timestamp"]), input_length=int(row["input_length"]),
                                  output_length=int(row["output_length"]),
                                  hash_ids=tuple(int(h) for h in row.get("hash_ids", ())))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace record: {e}") from e
            if rec.input_length < 1 or rec.output_length < 1:
                raise ValueError(f"{path}:{lineno}: input_length and output_length must be >= 1")
            if any(h < 0 for h in rec.hash_ids):
                raise ValueError(f"{path}:{lineno}: hash_ids must be >= 0")
            records.append(rec)
    if not records:
        raise ValueError(f"{path}: empty trace")
    return sorted(records, key=lambda r: r.timestamp_ms)  # stable: ties keep file order


def trace_requests(records: list[TraceRecord], builder: PromptBuilder, seed: int = 0,
                   block_size: int = BLOCK_SIZE) -> list[BenchRequest]:
    if block_size < 1:
        raise ValueError(f"--trace-block-size must be >= 1, got {block_size}")
    blocks: dict[int, list[int]] = {}

    def block(hash_id: int) -> list[int]:
        if hash_id not in blocks:
            blocks[hash_id] = builder.random_ids(np.random.default_rng([seed, 1, hash_id]), block_size)
        return blocks[hash_id]

    out = []
    for index, rec in enumerate(records):
        ids: list[int] = []
        for h in rec.hash_ids:
            if len(ids) >= rec.input_length:
                break
            ids += block(h)
        ids = ids[:rec.input_length]
        rng = np.random.default_rng([seed, 2, index])  # tokens past the listed blocks are the request's own
        ids += builder.random_ids(rng, rec.input_length - len(ids))
        text, prompt_len = builder.to_text(ids, rng)
        out.append(BenchRequest(prompt=text, prompt_len=prompt_len, expected_output_len=rec.output_length))
    return out
