"""ModelRunner: turns a SchedulerOutput into one forward pass and the sampled tokens.

It keeps its own per-request state (token ids, block ids, progress), updated from the deltas the
scheduler sends each step, and owns the paged KV cache: ONE tensor

    kv_caches: (num_layers, 2, num_blocks, block_size, num_kv_heads_local, head_dim)   [.., 0]=K, [.., 1]=V

so a KV connector can register a single memory region (in named shared memory when the
connector asks, so same-host peers can map it). With a connector the runner calls its worker side
around every step (connector_hooks.py). A request is sampled only when its
scheduled tokens reach the end of its known tokens (num_computed + num_scheduled == len(token_ids));
an intermediate prefill chunk gets an empty list.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from pdcluster.config import EngineConfig
from pdcluster.dtypes import torch_dtype
from pdcluster.engine.connector_hooks import ConnectorHooks
from pdcluster.engine.kv_connector import KVCacheLayout, KVConnectorBase
from pdcluster.engine.ngram_proposer import num_accepted
from pdcluster.engine.outputs import ModelRunnerOutput, RequestFault, SchedulerOutput
from pdcluster.engine.prompt_logprobs import chunk_prompt_logprobs
from pdcluster.engine.thread_tuner import ThreadTuner, step_key, step_plan
from pdcluster.env_flags import env_enabled
from pdcluster.models.layers.attention_backend import AttentionBackend, AttentionMetadata
from pdcluster.models.loader import load_model
from pdcluster.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class CachedRequestState:
    request_id: str
    token_ids: list[int]  # prompt + every output token known to the runner
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    grammar: Any = None  # structured_output.GrammarState when the request is constrained
    prompt_logprobs: int | None = None  # top-n of the prompt's logprobs, until they are delivered


def make_attention_backend(name: str) -> AttentionBackend:
    if name == "torch":
        from pdcluster.models.layers.torch_attention import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        from pdcluster.models.layers.triton_attention import TritonAttentionBackend  # lazy: imports triton

        return TritonAttentionBackend()
    raise ValueError(f"attention_backend must be 'torch' or 'triton', got {name!r}")


class ModelRunner:
    def __init__(self, config: EngineConfig, rank: int = 0, connector: KVConnectorBase | None = None) -> None:
        if os.environ.get("PDCLUSTER_NUM_THREADS"):
            torch.set_num_threads(int(os.environ["PDCLUSTER_NUM_THREADS"]))
        self.config = config
        self.rank = rank
        self.device = torch.device(config.device)
        self.block_size = config.cache.block_size
        self.attn_backend = make_attention_backend(config.attention_backend)
        self.model = load_model(config.model, self.attn_backend, config.ops_backend, self.device,
                                tp_rank=rank, tp_size=config.parallel.tensor_parallel_size)
        self._kv_region: Any = None  # the shared-memory Region under kv_caches, when used
        self.kv_caches = self._allocate_kv_cache(connector)
        # Per-layer views (2, num_blocks, block_size, Hk, D) into the one tensor.
        self.layer_kv_caches: list[torch.Tensor] = list(self.kv_caches.unbind(0))
        self.kv_scales: Any = None  # kv_quant.KVScales of an fp8 cache (checkpoint's, or 1.0)
        if self.kv_caches.dtype == torch.float8_e4m3fn:
            self._bind_kv_scales()
        self.requests: dict[str, CachedRequestState] = {}
        self.sampler: Any = None  # built on first use (pdcluster.engine.sampler)
        self._grammar_cache: Any = None  # built on first structured-output request
        self.connector_hooks: ConnectorHooks | None = None
        self.mm: Any = None  # mm_embedder.MultiModalEmbedder for a multimodal model (LLaVA)
        if getattr(self.model, "is_multimodal", False):
            from pdcluster.engine.mm_embedder import MultiModalEmbedder

            self.mm = MultiModalEmbedder(self.model, self.device, config.mm.encoder_cache_bytes)
        if connector is not None:
            self.connector_hooks = ConnectorHooks(connector, rank, config.parallel.tensor_parallel_size)
            self.connector_hooks.register(self.kv_caches, self.kv_cache_layout(), self.model)
        # The text forward: the model itself, or compiled_forward's torch.compile wrapper of it.
        self.forward_fn = self._build_forward()
        # Decode steps replayed from CUDA graphs (cuda_graphs.py); None on CPU and where refused.
        self.cuda_graphs: Any = None
        if self.device.type == "cuda":
            from pdcluster.engine import cuda_graphs

            self.cuda_graphs = cuda_graphs.build(config, self.model, self.kv_caches)
        if self.device.type == "cpu":
            # Build the C prefill-attention kernel (or load it from the disk cache) now: built on
            # first use it cost a fresh machine's first request ~1 s of compiler time.
            from pdcluster.kernels import prefill_attn_cpu

            prefill_attn_cpu.available()
        # The tuner changes a process-wide setting step by step: shutdown() puts this one back, so
        # whatever runs next in the process (another engine, a test) does not start from the
        # count of our last step.
        self._threads_at_start = torch.get_num_threads()
        self.thread_tuner = self._make_thread_tuner()

    def _make_thread_tuner(self) -> Any:
        """Eager steps' thread count chosen from measured step times (thread_tuner.py): on CPU,
        one rank, more than one thread, unless PDCLUSTER_ADAPTIVE_THREADS=0."""
        if (self.device.type != "cpu" or self.config.parallel.tensor_parallel_size > 1
                or torch.get_num_threads() < 2 or not env_enabled("PDCLUSTER_ADAPTIVE_THREADS")):
            return None
        return ThreadTuner(torch.get_num_threads())

    def _build_forward(self) -> Any:
        # Lazy: the custom attention op is registered only by engines that may compile.
        from pdcluster.engine.compiled_forward import build_forward, release_and_start

        forward = build_forward(self.config, self.model, self.attn_backend, self.layer_kv_caches)
        # A packed copy that serves every row count now runs every product of its layer (eagerly,
        # or through the compiled graph's packed_linear op): its plain copy would double that
        # weight's memory (bf16 copies serve small M only and keep theirs: cpu_gemm). A background
        # compile starts here (after the release) and keeps the LM head's until it is done.
        freed = release_and_start(forward, self.model)
        if freed:
            logger.info("released %.1f MiB of plain weights (oneDNN-packed copies in use)", freed / 2**20)
        return forward

    def compile_status(self) -> dict[str, Any]:
        """The forward's torch.compile state: eager / compiling / ready / compiled / failed, with
        compiled steps and compile seconds (compiled_forward.CompiledForward.status)."""
        status = getattr(self.forward_fn, "status", None)
        return status() if status is not None else {"state": "eager"}

    def _bind_kv_scales(self) -> None:
        from pdcluster.models.layers.kv_quant import load_kv_scales

        m = self.config.model
        self.kv_scales = load_kv_scales(m.model_path, m.num_hidden_layers, m.num_key_value_heads, self.device,
                                        self.rank, self.config.parallel.tensor_parallel_size)
        self.kv_scales.bind(self.layer_kv_caches)
        self.attn_backend.kv_scales = self.kv_scales  # type: ignore[attr-defined]

    def kv_cache_layout(self) -> KVCacheLayout:
        m, c = self.config.model, self.config.cache
        tp = self.config.parallel.tensor_parallel_size
        return KVCacheLayout(
            num_layers=m.num_hidden_layers, num_blocks=c.num_blocks, block_size=c.block_size,
            num_kv_heads=self.kv_caches.shape[4], head_dim=m.head_dim, dtype=c.kv_cache_dtype,
            tp_rank=self.rank, tp_size=tp, total_num_kv_heads=m.num_key_value_heads,
            shm_name=self._kv_region.shm_name if self._kv_region is not None else None)

    def handshake_metadata(self) -> Any:
        """This rank's connector handshake metadata (None without a connector)."""
        return self.connector_hooks.connector.handshake_metadata() if self.connector_hooks else None

    def shutdown(self) -> None:
        """Stop the connector's worker side, release the shared-memory cache (if any), and put
        back the thread count the tuner may have changed."""
        if self.connector_hooks is not None:
            self.connector_hooks.shutdown()
            self.connector_hooks = None
        if self._kv_region is not None:
            self._kv_region.close()  # unlinks the segment; our mapping lives while tensors do
            self._kv_region = None
        if self.device.type == "cpu" and torch.get_num_threads() != self._threads_at_start:
            torch.set_num_threads(self._threads_at_start)

    def _allocate_kv_cache(self, connector: KVConnectorBase | None) -> torch.Tensor:
        m, c = self.config.model, self.config.cache
        tp = self.config.parallel.tensor_parallel_size
        num_kv_heads = max(1, m.num_key_value_heads // tp)  # replicated when fewer heads than ranks
        shape = (m.num_hidden_layers, 2, c.num_blocks, c.block_size, num_kv_heads, m.head_dim)
        dtype = torch_dtype(c.kv_cache_dtype)
        if connector is not None and self.device.type == "cpu" and connector.wants_shared_kv_cache():
            # lazy: only connectors need the data plane
            from pdcluster.transfer import ShmSpaceError, alloc_region

            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            try:
                self._kv_region = alloc_region(nbytes, shared=True)  # zero-filled by ftruncate
            except ShmSpaceError as e:
                # Serving on beats a cache that would SIGBUS once its pages outgrow /dev/shm: the
                # cache stays private and same-host peers read it over TCP (the handshake names
                # no segment); a consumer that demands transport "shm" gets that refusal by name.
                logger.warning("KV cache kept in private memory, peers on this host read it over TCP: %s", e)
            else:
                # A forgotten shutdown() must not leave the segment in /dev/shm after the process exits.
                weakref.finalize(self, self._kv_region.close)
                return self._kv_region.as_tensor(dtype, shape)
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def _get_sampler(self) -> Any:
        if self.sampler is None:
            from pdcluster.engine.sampler import Sampler  # lazy: written alongside, imports torch only

            # A fixed seed: every TP rank must draw the same noise for unseeded random requests.
            self.sampler = Sampler(self.config.model.vocab_size, self.device, seed=self.config.seed)
        return self.sampler

    def grammar_cache(self) -> Any:
        """This runner's structured_output.GrammarCompilerCache (LLMEngine validates with it too)."""
        if self._grammar_cache is None:
            from pdcluster.engine.structured_output import GrammarCompilerCache  # lazy: imports xgrammar
            from pdcluster.engine.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_pretrained(self.config.tokenizer_path)
            self._grammar_cache = GrammarCompilerCache.from_tokenizer(
                tokenizer, self.config.model.vocab_size, list(tokenizer.eos_token_ids))
        return self._grammar_cache

    # -- state ------------------------------------------------------------------------------------
    def update_states(self, scheduler_output: SchedulerOutput) -> None:
        if self.mm is not None:
            self.mm.update(scheduler_output)
        for request_id in scheduler_output.finished_request_ids:
            self.requests.pop(request_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            grammar = None
            spec = new.sampling_params.structured_outputs
            if spec is not None:
                from pdcluster.engine.structured_output import build_state

                # Advanced over the outputs so far: a decode leg continues after the prefill
                # leg's token, a preempted request where it stopped.
                grammar = build_state(self.grammar_cache(), spec, tuple(new.eos_token_ids),
                                      new.sampling_params.stop_token_ids, list(new.output_token_ids))
            self.requests[new.request_id] = CachedRequestState(
                new.request_id, list(new.prompt_token_ids) + list(new.output_token_ids), len(new.prompt_token_ids),
                list(new.block_ids), new.num_computed_tokens, new.sampling_params, tuple(new.eos_token_ids),
                grammar,
                # Resumed after its first token (preempted): they went out with that token.
                new.sampling_params.prompt_logprobs if not new.output_token_ids else None)
        for cached in scheduler_output.scheduled_cached_reqs:
            state = self.requests[cached.request_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    # -- step -------------------------------------------------------------------------------------
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.update_states(scheduler_output)
        hooks = self.connector_hooks
        if hooks is not None:
            hooks.start(scheduler_output.kv_connector_metadata)  # also on empty steps: async loads start here
        reqs = [self.requests[r] for r, n in scheduler_output.num_scheduled_tokens.items() if n > 0]
        if not reqs:
            out = ModelRunnerOutput([], [])
        else:
            if hooks is not None:
                hooks.before_forward()
            out = self._tuned_forward(reqs, scheduler_output)
            if hooks is not None:
                hooks.after_forward()
        return hooks.finish(out) if hooks is not None else out

    def _tuned_forward(self, reqs: list[CachedRequestState], scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """_forward with the thread count the tuner picks for a step of this shape (and, for a
        step with prefill tokens on the compiled layers, eagerly when that count is not theirs)."""
        tuner = self.thread_tuner
        if tuner is None:
            return self._forward(reqs, scheduler_output)
        tokens = sum(scheduler_output.num_scheduled_tokens[r.request_id] for r in reqs)
        compiled = getattr(self.forward_fn, "state", "eager") in ("ready", "compiled")
        as_decode = self._as_decode(reqs, scheduler_output)
        rows = tokens if as_decode else len(reqs)  # decode rows, drafts' too
        key = step_key(rows, tokens)
        plan = step_plan(tuner, key, compiled_prefill=compiled and tokens != rows)
        if torch.get_num_threads() != plan.threads:
            torch.set_num_threads(plan.threads)
        t0 = time.perf_counter()
        out = self._forward(reqs, scheduler_output, eager=plan.eager)
        tuner.record(key, plan.threads, time.perf_counter() - t0)
        return out

    def _forward(self, reqs: list[CachedRequestState], scheduler_output: SchedulerOutput,
                 eager: bool = False) -> ModelRunnerOutput:
        # Drafts (speculative decoding) join the request's tokens for this forward only; after it
        # they are replaced by what the model produced (_take_sampled).
        spec = scheduler_output.scheduled_spec_token_ids
        for r in reqs:
            r.token_ids.extend(spec.get(r.request_id, ()))
        query_lens = [scheduler_output.num_scheduled_tokens[r.request_id] for r in reqs]
        input_ids, positions, meta = self.prepare_inputs(reqs, query_lens, self._as_decode(reqs, scheduler_output))
        # Sample where the chunk ends at the last known token. Rows of hidden to sample: that last
        # token, and with k drafts the k + 1 positions from the request's real last token on
        # (position j scores draft j; the last one gives the token after the final draft).
        do_sample = [r.num_computed_tokens + n == len(r.token_ids) for r, n in zip(reqs, query_lens)]
        rows: list[int] = []
        states: list[Any] = []
        for r, end, ok in zip(reqs, itertools.accumulate(query_lens), do_sample):
            k = len(spec.get(r.request_id, ()))
            if ok:
                rows.extend(range(end - 1 - k, end))
                states.extend(self._sampling_state(r, len(r.token_ids) - k + j, j if k else None)
                              for j in range(k + 1))
        with torch.inference_mode():
            embeds = None if self.mm is None else self.mm.inputs_embeds(
                [r.request_id for r in reqs], [r.num_computed_tokens for r in reqs], query_lens, input_ids)
            if embeds is not None:  # image features scattered into the placeholders' embeddings
                hidden = self.model(input_ids, positions, self.kv_caches, meta, inputs_embeds=embeds)
            else:
                # A decode step the CUDA graphs captured (else None), or the forward: (T, H);
                # `eager` only ever comes with a CompiledForward (_tuned_forward).
                hidden = None if self.cuda_graphs is None else self.cuda_graphs.run(input_ids, positions, meta)
                if hidden is None:
                    hidden = (self.forward_fn(input_ids, positions, self.kv_caches, meta, eager=True) if eager
                              else self.forward_fn(input_ids, positions, self.kv_caches, meta))
            prompt_logprobs = {} if not any(r.prompt_logprobs is not None for r in reqs) else chunk_prompt_logprobs(
                reqs, query_lens, hidden, self.model.compute_logits, self.config.model.vocab_size)
            sampled: list[int] = []
            logprobs: list[Any] = []
            if rows:
                logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
                sampled, logprobs = self._get_sampler()(logits, states)
        out = ModelRunnerOutput([r.request_id for r in reqs], [], [], prompt_logprobs=prompt_logprobs)
        results = iter(zip(sampled, logprobs, states))
        for r, n, ok in zip(reqs, query_lens, do_sample):
            if not ok:
                r.num_computed_tokens += n
                out.sampled_token_ids.append([])
                out.logprobs.append([])
                continue
            tokens, entries, fault = self._take_sampled(r, n, spec.get(r.request_id, ()), results)
            out.sampled_token_ids.append(tokens)
            out.logprobs.append(entries)
            if fault is not None:  # the scheduler ends it; our state goes with its finished id
                out.faults[r.request_id] = fault
        return out

    @staticmethod
    def _as_decode(reqs: list[CachedRequestState], scheduler_output: SchedulerOutput) -> bool:
        """A step of decodes, some checking drafts: every token runs as a decode row of its own
        (prepare_inputs), on the decode kernels, keyed for the thread tuner as such a batch."""
        spec = scheduler_output.scheduled_spec_token_ids
        return bool(spec) and all(scheduler_output.num_scheduled_tokens[r.request_id] == 1 or r.request_id in spec
                                  for r in reqs)

    @staticmethod
    def _take_sampled(r: CachedRequestState, n: int, drafts: Any, results: Any
                      ) -> tuple[list[int], list[Any], RequestFault | None]:
        """One request's sampled tokens from `results` (k + 1 of them with k drafts): the drafts
        the model agreed with, then its own next token; our state follows (the scheduler rolls its
        Request back the same way from the count). A kept row whose masks left it no token
        (SamplingState.fault) ends the request: the tokens before it, and the fault."""
        k = len(drafts)
        picked = [next(results) for _ in range(k + 1)]
        keep = num_accepted(drafts, [token for token, _, _ in picked]) + 1
        if k:
            del r.token_ids[-k:]
        failed = next((j for j, (_, _, state) in enumerate(picked[:keep]) if state.fault is not None), None)
        if failed is not None:  # our state goes with the finished id the scheduler sends
            return ([token for token, _, _ in picked[:failed]], [lp for _, lp, _ in picked[:failed] if lp is not None],
                    picked[failed][2].fault)
        tokens = [token for token, _, _ in picked[:keep]]
        r.token_ids.extend(tokens)  # our copy; the scheduler appends to its Request itself
        if k and r.grammar is not None:  # the sampler left a draft-checking request's matcher as it was
            r.grammar.advance(tokens)
        r.num_computed_tokens += n - (k + 1 - keep)  # rejected drafts' KV is overwritten later
        return tokens, [lp for _, lp, _ in picked[:keep] if lp is not None], None

    def _sampling_state(self, r: CachedRequestState, end: int | None = None, drafts_before: int | None = None
                        ) -> Any:
        """The sampler's view of r for the token after r.token_ids[:end] (default: all of them);
        drafts_before: in a step that checks r's drafts, how many of them that token follows."""
        from pdcluster.engine.sampler import SamplingState

        return SamplingState(r.sampling_params, r.token_ids[: r.num_prompt_tokens],
                             r.token_ids[r.num_prompt_tokens:end], r.eos_token_ids, r.grammar, drafts_before)

    def prepare_inputs(self, reqs: list[CachedRequestState], query_lens: list[int], as_decode: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flatten the scheduled tokens of every request into (T,) ids and positions, and build the
        attention metadata. Index math (see attention_backend.py):

            token t of request i: position = context_lens[i] + (t - query_start_loc[i])
            slot_mapping[t] = block_tables[i, position // block_size] * block_size + position % block_size

        as_decode: describe every token as a decode row of its own (its request's block table, the
        context up to its position), so a decode step that checks drafts runs the decode kernels
        (the one-call CPU driver, CUDA graphs). Exact: every attention path writes a step's K/V
        into the cache before any row reads it, so row j of a request sees the tokens before it.
        """
        block_size = self.block_size
        context_lens = [r.num_computed_tokens for r in reqs]
        seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
        ids: list[int] = []
        for r, c, s in zip(reqs, context_lens, seq_lens):
            if s > len(r.token_ids) or s > len(r.block_ids) * block_size:
                raise RuntimeError(f"request {r.request_id!r}: {s} tokens scheduled through but it has "
                                   f"{len(r.token_ids)} tokens and {len(r.block_ids)} blocks of {block_size}")
            ids.extend(r.token_ids[c:s])
        num_blocks = -(-max(seq_lens) // block_size)  # block-table columns needed this step
        if as_decode or all(n == 1 for n in query_lens):  # decode rows: the same index math on Python ints
            rows = [(r.block_ids, p) for r, c, s in zip(reqs, context_lens, seq_lens) for p in range(c, s)]
            table = [b[:num_blocks] + [0] * (num_blocks - len(b[:num_blocks])) for b, _ in rows]
            positions = [p for _, p in rows]
            slot_mapping = torch.tensor([b[p // block_size] * block_size + p % block_size for b, p in rows],
                                        dtype=torch.int64)
            return self._inputs(ids, torch.tensor(positions, dtype=torch.int64), slot_mapping,
                                torch.arange(len(rows) + 1, dtype=torch.int64), torch.tensor(table, dtype=torch.int32),
                                [1] * len(rows), [p + 1 for p in positions], positions)
        table = [r.block_ids[:num_blocks] + [0] * (num_blocks - len(r.block_ids[:num_blocks])) for r in reqs]
        block_tables = torch.tensor(table, dtype=torch.int32)  # (B, num_blocks)
        q_lens = torch.tensor(query_lens, dtype=torch.int64)
        query_start_loc = torch.zeros(len(reqs) + 1, dtype=torch.int64)
        torch.cumsum(q_lens, 0, out=query_start_loc[1:])
        req_of_token = torch.repeat_interleave(torch.arange(len(reqs)), q_lens)  # (T,)
        positions = (torch.arange(len(ids)) - query_start_loc[req_of_token]
                     + torch.tensor(context_lens, dtype=torch.int64)[req_of_token])  # (T,)
        slot_mapping = (block_tables[req_of_token, positions // block_size].long() * block_size
                        + positions % block_size)  # (T,)
        return self._inputs(ids, positions, slot_mapping, query_start_loc, block_tables, query_lens, seq_lens,
                            context_lens)

    def _inputs(self, ids: list[int], positions: torch.Tensor, slot_mapping: torch.Tensor,
                query_start_loc: torch.Tensor, block_tables: torch.Tensor, query_lens: list[int],
                seq_lens: list[int], context_lens: list[int]
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """prepare_inputs' result on the runner's device."""
        dev = self.device
        meta = AttentionMetadata(
            num_reqs=len(query_lens),
            num_tokens=len(ids),
            query_start_loc=query_start_loc.to(dev, torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev),
            block_tables=block_tables.to(dev),
            slot_mapping=slot_mapping.to(dev),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            context_lens_cpu=context_lens,
        )
        return torch.tensor(ids, dtype=torch.int64, device=dev), positions.to(dev), meta
