"""Decode steps on CUDA replayed from captured CUDA graphs (issue 14, "On CUDA").

Why: a decode step of a small model on a GPU is a few hundred kernel launches of microseconds
each, and issuing them from Python costs more than running them. Captured once per batch size,
the step's launches replay as one graph (vLLM and SGLang do the same).

What is captured: the text model's forward (embedding, layers, final norm) of a decode-only step
of B rows, for B on a ladder of sizes (`capture_sizes`), each on its own static input tensors.
The LM head and sampling stay eager: their shape is the real batch. A step of n requests replays
the graph of the smallest size >= n (`pick_size`); `StaticBatch.load` copies the step's inputs
into the static tensors and fills rows n.. with padding that reads one block and writes nothing:

    token 0, position 0, slot -1 (the cache write skips it), seq_len 1, block table row 0

Grids fixed at capture: the decode attention kernel sizes its split-KV grid from max_seq_len,
so graphs are captured with max_seq_len = max_model_len and serve every context length (splits
past a request's seq_len exit at once); block tables are max_model_len / block_size wide.

Checked at capture, per size: one replay on random tokens must equal an eager forward of the same
padded batch bit for bit (the same kernels on the same inputs). A capture that raises or differs
drops every graph, logged, and steps run eagerly as before: a capture problem costs speed, never
tokens. Against an eager step of the unpadded n rows the replay may differ in the last bits (a
GEMM of M = B may pick another algorithm than M = n), as in vLLM; tests compare greedy tokens.

When (`why_not`): CUDA, tensor parallel size 1, a decoder of dense MLP layers (MoE routing is
host-driven), no per-layer forward hook other than a KV connector's args-free ones (run all
before the replay and all after it, as the CPU decode driver does), not enforce_eager, and
PDCLUSTER_CUDA_GRAPHS not "0". Steps with more rows than the largest size, with prefill tokens, or
with image embeddings run eagerly.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from pdcluster.env_flags import env_enabled
from pdcluster.models.cpu_decode_step import layer_hooks
from pdcluster.models.layers.attention_backend import AttentionMetadata

log = logging.getLogger(__name__)
ENV = "PDCLUSTER_CUDA_GRAPHS"  # "0" / "false" / "off" / "no": decode steps run eagerly on CUDA
# 1, 2, 4, 8, then every 8 to 64, every 32 to 256: padding wastes at most 7 / 31 rows, and the
# ladder stays short enough to capture in seconds at start-up.
_LADDER = (1, 2, 4, *range(8, 64, 8), *range(64, 257, 32))


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The batch sizes to capture: the ladder up to max_num_seqs, and max_num_seqs itself (<= 256)."""
    top = min(max_num_seqs, _LADDER[-1])
    return tuple(sorted({s for s in _LADDER if s <= top} | {top}))


def pick_size(sizes: tuple[int, ...], n: int) -> int | None:
    """The smallest captured size that holds n rows, or None (run eagerly)."""
    return next((s for s in sizes if s >= n), None) if n > 0 else None


@dataclass
class StaticBatch:
    """The fixed tensors one graph reads and writes; `meta` points into them."""

    input_ids: torch.Tensor     # (B,) int64
    positions: torch.Tensor     # (B,) int64
    slot_mapping: torch.Tensor  # (B,) int64, -1 = padding (not written)
    block_tables: torch.Tensor  # (B, max_blocks) int32
    seq_lens: torch.Tensor      # (B,) int32
    context_lens: torch.Tensor  # (B,) int32
    meta: AttentionMetadata

    @classmethod
    def make(cls, size: int, max_model_len: int, block_size: int, device: torch.device) -> StaticBatch:
        max_blocks = -(-max_model_len // block_size)
        i64 = dict(dtype=torch.int64, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        return cls._over(torch.zeros(size, **i64), torch.zeros(size, **i64), torch.full((size,), -1, **i64),
                         torch.zeros(size, max_blocks, **i32), torch.ones(size, **i32), torch.zeros(size, **i32),
                         torch.arange(size + 1, **i32), max_model_len)

    def view(self, size: int) -> StaticBatch:
        """The first `size` rows of these tensors (no copy): every graph size shares the largest
        one's inputs (a block table of max_model_len / block_size columns per row adds up)."""
        if not 0 < size <= self.size:
            raise ValueError(f"a view of {size} rows of a static batch of {self.size}")
        return self._over(self.input_ids[:size], self.positions[:size], self.slot_mapping[:size],
                          self.block_tables[:size], self.seq_lens[:size], self.context_lens[:size],
                          self.meta.query_start_loc[: size + 1], self.meta.max_seq_len)

    @classmethod
    def _over(cls, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
              block_tables: torch.Tensor, seq_lens: torch.Tensor, context_lens: torch.Tensor,
              query_start_loc: torch.Tensor, max_model_len: int) -> StaticBatch:
        size = input_ids.shape[0]
        meta = AttentionMetadata(
            num_reqs=size, num_tokens=size, query_start_loc=query_start_loc, seq_lens=seq_lens,
            context_lens=context_lens, block_tables=block_tables, slot_mapping=slot_mapping, max_query_len=1,
            # Upper bounds: the captured grids serve every step (module docstring).
            max_seq_len=max_model_len, query_lens_cpu=[1] * size, seq_lens_cpu=[max_model_len] * size,
            context_lens_cpu=[max_model_len - 1] * size)
        return cls(input_ids, positions, slot_mapping, block_tables, seq_lens, context_lens, meta)

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """A decode step of n <= size rows into the static tensors; rows n.. become padding."""
        n, width = meta.num_reqs, meta.block_tables.shape[1]
        if n > self.size or width > self.block_tables.shape[1]:
            raise ValueError(f"a step of {n} rows x {width} blocks does not fit a graph of "
                             f"{self.size} x {self.block_tables.shape[1]}")
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.context_lens[:n].copy_(meta.context_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        if n < self.size:
            self.pad(n)

    def pad(self, n: int) -> None:
        self.input_ids[n:].zero_()
        self.positions[n:].zero_()
        self.slot_mapping[n:].fill_(-1)
        self.seq_lens[n:].fill_(1)
        self.context_lens[n:].zero_()
        self.block_tables[n:].zero_()


def why_not(config: Any, model: Any) -> str | None:
    """Why this engine's decode steps are not captured, or None when they are."""
    from pdcluster.models.decoder import DecoderModel
    from pdcluster.models.layers.mlp import MLP

    if not env_enabled(ENV):
        return f"{ENV}=0"
    if getattr(config, "enforce_eager", False):
        return "enforce_eager"
    if not str(config.device).startswith("cuda"):
        return "not CUDA"
    if config.parallel.tensor_parallel_size != 1:
        return "tensor parallel"
    decoder = getattr(model, "model", None)
    if not isinstance(decoder, DecoderModel):
        return f"{type(model).__name__} is not a plain decoder"
    if any(not isinstance(layer.mlp, MLP) for layer in decoder.layers):
        return "MoE layers (host-driven routing)"
    return None


@contextlib.contextmanager
def _no_layer_hooks(decoder: Any) -> Iterator[None]:
    """The layers' hooks set aside while capturing: a connector's hooks do host work that must run
    at every step (around the replay), not once inside the graph."""
    saved = [(layer, layer._forward_pre_hooks, layer._forward_hooks) for layer in decoder.layers]
    for layer, _, _ in saved:
        layer._forward_pre_hooks, layer._forward_hooks = type(layer._forward_pre_hooks)(), type(layer._forward_hooks)()
    try:
        yield
    finally:
        for layer, pre, post in saved:
            layer._forward_pre_hooks, layer._forward_hooks = pre, post


class CudaCapture:
    """torch.cuda.CUDAGraph capture and replay (the default; `EagerCapture` is its CPU stand-in
    for tests of everything around it: static tensors, padding, hooks)."""

    def __init__(self, device: torch.device) -> None:
        self.pool = torch.cuda.graph_pool_handle()  # one memory pool for every size
        self.device = device

    def capture(self, forward: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            forward()  # warm-up off the graph: Triton compiles, cuBLAS picks its algorithms
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA work (a connector's copies) neither joins the graph
        # nor fails the capture.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = forward()
        return graph.replay, out


class EagerCapture:
    """Runs the forward eagerly on the static tensors at every 'replay' (no GPU needed)."""

    def capture(self, forward: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        out = forward()

        def replay() -> None:
            out.copy_(forward())
        return replay, out


@dataclass
class _Graph:
    batch: StaticBatch
    replay: Callable[[], None]
    out: torch.Tensor  # (B, H): the forward's output, written by each replay


class DecodeGraphs:
    """One engine's captured decode steps: `run` returns a decode step's hidden states, or None
    when the step runs eagerly."""

    def __init__(self, model: Any, kv_caches: Any, sizes: tuple[int, ...], max_model_len: int, block_size: int,
                 device: torch.device, vocab_size: int, capture: Any = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.device = device
        self.graphs: dict[int, _Graph] = {}
        self.sizes: tuple[int, ...] = ()
        self.replays = 0  # decode steps replayed (tests and stats read it)
        self.error: str | None = None
        self._capture(sizes, max_model_len, block_size, vocab_size,
                      capture if capture is not None else CudaCapture(device))

    def _capture(self, sizes: tuple[int, ...], max_model_len: int, block_size: int, vocab_size: int,
                 capture: Any) -> None:
        decoder = self.model.model
        gen = torch.Generator().manual_seed(0)
        try:
            with torch.inference_mode():
                largest = StaticBatch.make(max(sizes), max_model_len, block_size, self.device)
                for size in sorted(sizes, reverse=True):  # largest first: the pool's blocks fit the rest
                    batch = largest.view(size)

                    def forward(b: StaticBatch = batch) -> torch.Tensor:
                        with _no_layer_hooks(decoder):  # a graph holds kernels only (run() calls the hooks)
                            return self.model(b.input_ids, b.positions, self.kv_caches, b.meta)
                    replay, out = capture.capture(forward)
                    # Random tokens and positions over padding rows (which write nothing): the
                    # replay must equal an eager forward of the same batch bit for bit.
                    batch.input_ids.copy_(torch.randint(0, vocab_size, (size,), generator=gen))
                    batch.positions.copy_(torch.randint(0, max_model_len, (size,), generator=gen))
                    replay()
                    got = out.clone()
                    want = forward()
                    if not torch.equal(got, want):
                        raise RuntimeError(f"the graph of {size} rows replayed other values than the eager "
                                           f"forward (max diff {(got.float() - want.float()).abs().max().item():.3g})")
                    batch.pad(0)
                    self.graphs[size] = _Graph(batch, replay, out)
        except Exception as e:  # noqa: BLE001 - any capture failure: eager steps, the engine still works
            self.graphs.clear()
            self.error = f"{type(e).__name__}: {e}"
            log.warning("CUDA graph capture failed; decode steps run eagerly: %s", self.error)
            return
        self.sizes = tuple(sorted(self.graphs))
        log.info("captured decode steps for batch sizes %s", list(self.sizes))

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        if not meta.is_decode_only or meta.num_tokens != meta.num_reqs:
            return None
        size = pick_size(self.sizes, meta.num_reqs)
        if size is None:
            return None
        hooks = layer_hooks(self.model.model)
        if hooks is None:  # a hook that reads a layer's inputs: only the eager layers can serve it
            return None
        graph = self.graphs[size]
        graph.batch.load(input_ids, positions, meta)
        pre, post = hooks
        for layer, hook in pre:  # a KV connector's wait_for_layer_load, every layer before the replay
            hook(layer, ())
        graph.replay()
        for layer, hook in post:  # its save_kv_layer: each layer's cache is final once the replay ran
            hook(layer, (), None)
        self.replays += 1
        return graph.out[: meta.num_reqs]

    def status(self) -> dict[str, Any]:
        return {"sizes": list(self.sizes), "replays": self.replays, "error": self.error}


def build(config: Any, model: Any, kv_caches: Any, capture: Any = None) -> DecodeGraphs | None:
    """The engine's decode graphs, or None (logged why) when its steps run eagerly. `capture`
    replaces CUDA capture (tests on a CPU pass EagerCapture and skip the device check)."""
    why = why_not(config, model) if capture is None else None
    if why is not None:
        log.info("decode steps are not captured as CUDA graphs: %s", why)
        return None
    return DecodeGraphs(model, kv_caches, capture_sizes(config.scheduler.max_num_seqs), config.model.max_model_len,
                        config.cache.block_size, torch.device(config.device), config.model.vocab_size, capture)
