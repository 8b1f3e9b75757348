from __future__ import annotations

import json
import pathlib

import pytest

from pdcluster.cluster.bench.prompts import PromptBuilder
from pdcluster.cluster.bench.trace import read_trace, trace_requests

BLOCK = 8  # small blocks keep the test fast; the reader's default is Mooncake's 512

TRACE = [
    {"timestamp": 0, "input_length": 20, "output_length": 4, "hash_ids": [1, 2, 3]},
    {"timestamp": 250, "input_length": 24, "output_length": 2, "hash_ids": [1, 2, 4]},
    {"timestamp": 100, "input_length": 16, "output_length": 3, "hash_ids": [5, 2]},
    {"timestamp": 900, "input_length": 30, "output_length": 1, "hash_ids": [1, 2, 3]},
]


@pytest.fixture
def trace_file(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "mooncake.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in TRACE))
    return path


def _ids(builder: PromptBuilder, text: str) -> list[int]:
    return builder.tokenizer.encode(text, add_special_tokens=False).ids


def test_read_sorts_by_timestamp(trace_file: pathlib.Path) -> None:
    records = read_trace(trace_file)
    assert [r.timestamp_ms for r in records] == [0, 100, 250, 900]
    assert records[1].hash_ids == (5, 2) and records[1].output_length == 3
    assert len(read_trace(trace_file, num_requests=2)) == 2


def test_shared_hash_ids_share_prefix_tokens(trace_file: pathlib.Path, builder: PromptBuilder) -> None:
    records = read_trace(trace_file)  # order: t=0 [1,2,3], t=100 [5,2], t=250 [1,2,4], t=900 [1,2,3]+6
    reqs = trace_requests(records, builder, seed=0, block_size=BLOCK)
    ids = [_ids(builder, r.prompt) for r in reqs]
    assert [len(x) for x in ids] == [20, 16, 24, 30] == [r.prompt_len for r in reqs]
    assert [r.expected_output_len for r in reqs] == [4, 3, 2, 1]
    a, b, c, d = ids
    assert a[:16] == c[:16]  # blocks 1, 2 shared
    assert a[16:20] == d[16:20] and c[16:20] != a[16:20]  # block 3 (partial in a) vs block 4
    assert b[8:16] == a[8:16]  # block 2 is the same content wherever it appears
    assert b[:8] != a[:8]
    assert d[:24] == a[:16] + d[16:24] and len(d) == 30  # past its listed blocks: its own tokens


def test_prompts_depend_on_seed_not_on_order(trace_file: pathlib.Path, builder: PromptBuilder) -> None:
    records = read_trace(trace_file)
    forward = trace_requests(records, builder, seed=1, block_size=BLOCK)
    assert forward == trace_requests(records, builder, seed=1, block_size=BLOCK)
    assert forward != trace_requests(records, builder, seed=2, block_size=BLOCK)
    # block 2 seen first by a later request gives the same tokens
    alone = trace_requests([records[1]], builder, seed=1, block_size=BLOCK)
    assert _ids(builder, alone[0].prompt)[8:16] == _ids(builder, forward[0].prompt)[8:16]


@pytest.mark.parametrize("line", ['{"timestamp": 0, "input_length": 5}', "{}", "oops",
                                  '{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}',
                                  '{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [-1]}'])
def test_bad_lines_name_the_line(tmp_path: pathlib.Path, line: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(TRACE[0]) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=":2:"):
        read_trace(path)
