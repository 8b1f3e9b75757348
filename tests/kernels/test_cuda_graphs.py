"""Decode steps replayed from captured CUDA graphs (engine/cuda_graphs.py).

On CUDA (`gpu`-marked): the engine captures its decode steps at start-up; greedy tokens equal the
same engine with PDCLUSTER_CUDA_GRAPHS=0, over batch compositions that shrink as requests finish
(so padded sizes replay), and every size passed its capture check.

Without CUDA: everything around the capture runs for real on the Triton kernels (the CPU
interpreter, as the rest of this folder): the static tensors, the padding rows (slot -1, seq_len
1), the size ladder, the connector-hook handling. `EagerCapture` stands in for the graph only: it
runs the same forward on the same static tensors a replay would read."""

from __future__ import annotations

import pytest
import torch

from pdcluster import LLM, SamplingParams
from pdcluster.engine import cuda_graphs
from pdcluster.engine.cuda_graphs import EagerCapture, StaticBatch, capture_sizes, pick_size
from pdcluster.models.layers.attention_backend import AttentionMetadata

PROMPTS = [[5, 9, 31, 7, 100, 3, 3, 8, 15, 2, 60], [44, 12, 9], [17, 4, 88, 21, 6]]
# Different lengths: the batch goes 3 -> 2 -> 1 rows, replaying the graphs of 4, 2 and 1.
PARAMS = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (9, 3, 6)]


def test_capture_sizes_and_the_graph_a_step_takes() -> None:
    assert capture_sizes(4) == (1, 2, 4)
    assert capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    sizes = capture_sizes(1024)
    assert sizes[:5] == (1, 2, 4, 8, 16) and sizes[-1] == 256 and len(sizes) < 20
    assert [pick_size(capture_sizes(20), n) for n in (1, 3, 5, 16, 17, 20, 21, 0)] == [1, 4, 8, 16, 20, 20, None, None]


def _meta(n: int, width: int) -> AttentionMetadata:
    i32 = dict(dtype=torch.int32)
    return AttentionMetadata(
        num_reqs=n, num_tokens=n, query_start_loc=torch.arange(n + 1, **i32), seq_lens=torch.arange(5, 5 + n, **i32),
        context_lens=torch.arange(4, 4 + n, **i32), block_tables=torch.arange(1, 1 + n * width, **i32).view(n, width),
        slot_mapping=torch.arange(10, 10 + n, dtype=torch.int64), max_query_len=1, max_seq_len=4 + n,
        query_lens_cpu=[1] * n, seq_lens_cpu=list(range(5, 5 + n)), context_lens_cpu=list(range(4, 4 + n)))


def test_a_step_loads_into_the_static_batch_and_the_rest_is_padding_that_writes_nothing() -> None:
    batch = StaticBatch.make(4, max_model_len=64, block_size=4, device=torch.device("cpu"))
    assert batch.block_tables.shape == (4, 16) and batch.meta.max_seq_len == 64
    batch.load(torch.tensor([7, 8, 9, 10]), torch.tensor([4, 5, 6, 7]), _meta(4, 3))  # a full batch first
    batch.load(torch.tensor([7, 8]), torch.tensor([4, 5]), _meta(2, 3))  # then a smaller one: rows 2.. reset
    assert batch.input_ids.tolist() == [7, 8, 0, 0] and batch.positions.tolist() == [4, 5, 0, 0]
    assert batch.slot_mapping.tolist() == [10, 11, -1, -1]
    assert batch.seq_lens.tolist() == [5, 6, 1, 1] and batch.context_lens.tolist() == [4, 5, 0, 0]
    assert batch.block_tables[:2, :3].tolist() == [[1, 2, 3], [4, 5, 6]] and not batch.block_tables[2:].any()
    with pytest.raises(ValueError, match="does not fit a graph of 4"):
        batch.load(torch.zeros(5, dtype=torch.int64), torch.zeros(5, dtype=torch.int64), _meta(5, 3))
    with pytest.raises(ValueError, match="17 blocks"):
        batch.load(torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), _meta(1, 17))
    # Smaller graphs read the first rows of the largest one's tensors: no copy of its block table.
    small = batch.view(2)
    assert small.block_tables.data_ptr() == batch.block_tables.data_ptr() and small.meta.num_reqs == 2
    assert small.meta.query_start_loc.tolist() == [0, 1, 2] and small.meta.max_seq_len == 64
    small.load(torch.tensor([3]), torch.tensor([9]), _meta(1, 2))
    assert batch.input_ids.tolist() == [3, 0, 0, 0] and batch.slot_mapping.tolist() == [10, -1, -1, -1]
    with pytest.raises(ValueError, match="a view of 5 rows"):
        batch.view(5)


def test_refused_where_a_graph_cannot_serve(tmp_path) -> None:
    from tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint("llama", tmp_path / "llama", dtype=torch.float32)
    llm = LLM(path, dtype="float32", block_size=4, max_model_len=64, enforce_eager=True)
    try:
        runner = llm.engine.core.runner
        assert runner.cuda_graphs is None  # a CPU engine never builds them
        cfg = runner.config
        assert cuda_graphs.why_not(cfg, runner.model) in ("enforce_eager", "not CUDA")
    finally:
        llm.shutdown()


def _generate(path: str, graphs: bool) -> tuple[list[list[int]], dict]:
    llm = LLM(path, dtype="float32", attention_backend="triton", ops_backend="triton", block_size=4,
              max_model_len=64, max_num_seqs=4)
    try:
        runner = llm.engine.core.runner
        if graphs:
            runner.cuda_graphs = cuda_graphs.build(runner.config, runner.model, runner.kv_caches,
                                                   capture=EagerCapture())
        outs = llm.generate(PROMPTS, PARAMS)
        status = runner.cuda_graphs.status() if graphs else {}
        return [list(o.outputs[0].token_ids) for o in outs], status
    finally:
        llm.shutdown()


@pytest.mark.timeout(900)
def test_padded_static_decode_steps_equal_plain_steps(tmp_path) -> None:
    from tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint("llama", tmp_path / "llama", dtype=torch.float32)
    plain, _ = _generate(path, graphs=False)
    padded, status = _generate(path, graphs=True)
    assert padded == plain
    assert status["sizes"] == [1, 2, 4] and status["error"] is None
    assert status["replays"] >= sum(p.max_tokens for p in PARAMS) // 3  # most decode steps replayed


@pytest.mark.gpu
def test_captured_decode_steps_equal_eager_on_cuda(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint("llama", tmp_path / "llama", dtype=torch.bfloat16)
    runs = {}
    for on in (True, False):
        monkeypatch.setenv("PDCLUSTER_CUDA_GRAPHS", "1" if on else "0")
        llm = LLM(path, device="cuda", block_size=16, max_model_len=256, max_num_seqs=8)
        try:
            graphs = llm.engine.core.runner.cuda_graphs
            runs[on] = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, PARAMS)]
            if on:
                assert graphs is not None and graphs.error is None and graphs.sizes == (1, 2, 4, 8)
                assert graphs.replays > 0
            else:
                assert graphs is None
        finally:
            llm.shutdown()
    assert runs[True] == runs[False]


def test_connector_hooks_run_around_each_replay_and_other_hooks_keep_steps_eager(tmp_path) -> None:
    """A KV connector's per-layer hooks (marked args_free) run at every replayed step, all before it
    and all after it; any other hook needs the eager layers, so such a step is not replayed."""
    from tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint("llama", tmp_path / "llama", dtype=torch.float32)
    llm = LLM(path, dtype="float32", attention_backend="triton", ops_backend="triton", block_size=4,
              max_model_len=64, max_num_seqs=4)
    try:
        runner = llm.engine.core.runner
        graphs = runner.cuda_graphs = cuda_graphs.build(runner.config, runner.model, runner.kv_caches,
                                                         capture=EagerCapture())
        layers = list(runner.model.model.layers)
        calls: list[str] = []

        def pre(layer, args):
            calls.append("pre")
        pre.args_free = True

        def post(layer, args, out):
            calls.append("post")
        post.args_free = True
        handles = [h for layer in layers for h in (layer.register_forward_pre_hook(pre),
                                                   layer.register_forward_hook(post))]
        llm.generate([PROMPTS[1]], [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)])
        assert graphs.replays == 2  # the prefill step ran eagerly, both decode steps replayed
        assert calls == (["pre", "post"] * len(layers)  # the eager prefill: per layer
                         + (["pre"] * len(layers) + ["post"] * len(layers)) * 2)  # each replay: around it
        unmarked = layers[0].register_forward_pre_hook(lambda layer, args: None)
        llm.generate([PROMPTS[1]], [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)])
        assert graphs.replays == 2  # not replayed: the unmarked hook must see the layer's inputs
        for h in [*handles, unmarked]:
            h.remove()
    finally:
        llm.shutdown()
