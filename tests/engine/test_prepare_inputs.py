"""ModelRunner.prepare_inputs against the index math of its docstring, for decode-only steps (a
path of its own on Python ints) and for steps with prefill chunks, over shuffled block ids and
contexts that end on, before and after block boundaries."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import make_tiny_checkpoint

from pdcluster.config import EngineArgs
from pdcluster.engine.model_runner import ModelRunner
from pdcluster.engine.outputs import NewRequestData, SchedulerOutput
from pdcluster.sampling_params import SamplingParams

BS = 4


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> ModelRunner:
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("ckpt") / "llama")
    cfg = EngineArgs(model=path, block_size=BS, num_kv_blocks=128, max_model_len=96, device="cpu",
                     enforce_eager=True).create_engine_config()
    return ModelRunner(cfg)


def _expected(reqs, query_lens):
    ids, pos, slots = [], [], []
    for r, n in zip(reqs, query_lens):
        c = r.num_computed_tokens
        ids += r.token_ids[c:c + n]
        for p in range(c, c + n):
            pos.append(p)
            slots.append(r.block_ids[p // BS] * BS + p % BS)
    return ids, pos, slots


@pytest.mark.parametrize("query_lens", [[1], [1, 1, 1, 1, 1], [1, 3, 1], [2, 1]], ids=["d1", "d5", "mixed", "chunk"])
def test_matches_the_index_math(runner: ModelRunner, query_lens: list[int]) -> None:
    rng = random.Random(len(query_lens) * 10 + sum(query_lens))
    blocks = list(range(128))
    rng.shuffle(blocks)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    new = []
    for i, _ in enumerate(query_lens):
        prompt = [rng.randrange(3, 300) for _ in range(rng.choice([3, 4, 5, 8, 13, 20]))]
        new.append(NewRequestData(f"q{i}", prompt, [], params, blocks[i * 8:(i + 1) * 8], 0))
    runner.update_states(SchedulerOutput(new, [], {n.request_id: 1 for n in new}, len(new)))
    reqs = [runner.requests[n.request_id] for n in new]
    for r, n in zip(reqs, query_lens):
        r.num_computed_tokens = len(r.token_ids) - n  # the last n tokens are this step's
    input_ids, positions, meta = runner.prepare_inputs(reqs, query_lens)
    ids, pos, slots = _expected(reqs, query_lens)
    assert input_ids.tolist() == ids and positions.tolist() == pos and meta.slot_mapping.tolist() == slots
    assert positions.dtype == meta.slot_mapping.dtype == torch.int64
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    assert meta.query_start_loc.tolist() == starts and meta.query_start_loc.dtype == torch.int32
    assert meta.seq_lens.tolist() == [r.num_computed_tokens + n for r, n in zip(reqs, query_lens)]
    assert meta.max_query_len == max(query_lens) and meta.num_tokens == len(ids)
    width = meta.block_tables.shape[1]
    assert meta.block_tables.tolist() == [r.block_ids[:width] for r in reqs]
    runner.update_states(SchedulerOutput([], [], {}, 0, finished_request_ids={n.request_id for n in new}))
