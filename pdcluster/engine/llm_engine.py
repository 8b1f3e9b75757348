"""LLMEngine: EngineCore plus the text layer (tokenizer, input validation, detokenization, stop
strings). Single-threaded: LLM drives it directly and AsyncEngine drives it from one thread."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any

from pdcluster.config import EngineArgs, EngineConfig
from pdcluster.engine.ec_engine import ECConnectorArg, EngineEC, build_ec_connector
from pdcluster.engine.ec_transfer_params import ECTransferParams, check_ec_params_list
from pdcluster.engine.engine_core import ConnectorArg, EngineCore
from pdcluster.engine.executor import ExecutorFactory, default_executor
from pdcluster.engine.input_processor import process_prompt, resolve_token_masks, validate_request_id
from pdcluster.engine.kv_transfer_params import KVTransferParams
from pdcluster.engine.mm_inputs import make_mm_processor
from pdcluster.engine.outputs import EngineCoreOutput, RequestOutput
from pdcluster.engine.request import Request
from pdcluster.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, connector: ConnectorArg = None,
                 executor: ExecutorFactory | None = None, ec_connector: ECConnectorArg = None) -> None:
        """`executor`: what runs the model (engine/executor.py); by default a ModelRunner, or the
        TP executor when tensor_parallel_size > 1 (the EncoderRunner for encoder_only).
        `ec_connector`: the EC connector (engine/ec_connector.py), an instance or a factory."""
        from pdcluster.engine.output_processor import OutputProcessor
        from pdcluster.engine.tokenizer import Tokenizer

        self.config = config
        self.tokenizer = Tokenizer.from_pretrained(config.tokenizer_path)
        self.core = EngineCore(config, executor or default_executor(config), connector=connector)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self._grammar_cache: Any = None  # only when the executor has none (structured output)
        self.mm_processor = make_mm_processor(config)  # None for a text-only model
        self.ec: EngineEC | None = None
        ec = build_ec_connector(config, ec_connector)
        if ec is not None:
            self.ec = EngineEC(ec, getattr(self.core.runner, "mm", None))

    @classmethod
    def from_engine_args(cls, args: EngineArgs, connector: ConnectorArg = None,
                         executor: ExecutorFactory | None = None, ec_connector: ECConnectorArg = None) -> LLMEngine:
        return cls(args.create_engine_config(), connector=connector, executor=executor, ec_connector=ec_connector)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        # The model's eos ids plus the tokenizer's (which include generation_config.json's, e.g.
        # Llama-3 instruct's <|eot_id|>).
        ids = list(self.config.model.eos_token_ids)
        for t in getattr(self.tokenizer, "eos_token_ids", ()) or ():
            if t not in ids:
                ids.append(t)
        return tuple(ids)

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def prepare_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        kv_transfer_params: KVTransferParams | None = None,
        prefill_output_token_ids: Sequence[int] | None = None,
        multi_modal_data: dict[str, Any] | None = None,
        ec_transfer_params: Sequence[ECTransferParams] = (),
        compile_grammar: bool = True,
    ) -> tuple[Request, str | None]:
        """Validate and tokenize (thread-safe, touches no engine state). Raises ValueError.
        compile_grammar=False leaves the structured-output spec to a later check_grammar() call
        (AsyncEngine runs that one on a worker thread: a grammar may compile for a while).

        Decode leg of a disaggregated request: the same prompt, the prefill leg's
        kv_transfer_params with do_remote_prefill=True, and prefill_output_token_ids = the token(s)
        the prefill leg sampled. The request starts with them as output (they count against
        max_tokens, are detokenization context, and are not emitted again), so the KV of the
        prompt is loaded, the first token's KV is computed here and sampling continues at output
        position 1: the same tokens as an aggregated run, greedy or seeded.

        multi_modal_data ({"image": PIL image(s)}): each `<image>` in the text prompt is expanded
        to the image's placeholder tokens (engine/mm_inputs.py). ec_transfer_params: producers
        that hold the images' encoder outputs (the caller fetches them: AsyncEngine.generate)."""
        if self.config.encoder_only:
            raise ValueError("this engine is encoder_only: it serves encode(), not generate()")
        ec_params = check_ec_params_list(tuple(ec_transfer_params or ()))
        params = params if params is not None else SamplingParams()
        if params.n != 1:
            raise ValueError(f"n must be 1 for one engine request (got {params.n}): LLM.generate and the HTTP "
                             "frontend fan out n sequences; a gRPC Generate streams one")
        request_id = validate_request_id(request_id if request_id is not None else self.new_request_id())
        mm_prompt, pixels = None, None
        if multi_modal_data is not None:
            if params.truncate_prompt_tokens is not None:  # a cut could split an image's placeholders
                raise ValueError("truncate_prompt_tokens cannot be combined with images")
            if self.mm_processor is None:
                raise ValueError(f"multi_modal_data: model {self.config.model.architecture} takes no images")
            mm_prompt, pixels = self.mm_processor.preprocess(prompt, multi_modal_data)
        text, ids = process_prompt(prompt if mm_prompt is None else mm_prompt, params, self.tokenizer,
                                   self.config.model.vocab_size, self.config.scheduler.max_model_len)
        mm_features = None
        if self.mm_processor is not None and pixels is not None:
            mm_features = self.mm_processor.features(ids, pixels)
            text = prompt if isinstance(prompt, str) else text  # the user's prompt, not the expansion
        prior = check_prior_tokens(prefill_output_token_ids, params, len(ids), self.config)
        if params.prompt_logprobs is not None and (prior or (kv_transfer_params is not None
                                                            and kv_transfer_params.do_remote_prefill)):
            raise ValueError("prompt_logprobs: only a leg that computes the prompt itself returns them, not one that "
                             "continues after earlier output tokens or loads the prompt's KV")
        if params.logit_bias and params.logit_bias[-1][0] >= self.config.model.vocab_size:
            raise ValueError(f"logit_bias: token id {params.logit_bias[-1][0]} is outside the vocabulary "
                             f"[0, {self.config.model.vocab_size})")
        if params.priority and self.config.scheduler.policy != "priority":
            raise ValueError(f"priority={params.priority}: this engine schedules first come, first served; start it "
                             "with --scheduling-policy priority to order requests by priority")
        params = resolve_token_masks(params, self.tokenizer, self.config.model.vocab_size, self.eos_token_ids)
        if params.structured_outputs is not None and compile_grammar:
            self.check_grammar(params)
        req = Request(request_id, ids, params, eos_token_ids=self.eos_token_ids,
                      kv_transfer_params=kv_transfer_params, output_token_ids=prior, mm_features=mm_features)
        req.ec_transfer_params = ec_params
        return req, text

    def check_grammar(self, params: SamplingParams) -> None:
        """Compile now (ValueError naming structured_outputs.<kind>), into the cache the runner
        reads; an executor without one (tensor parallel) gets a cache of the engine's own."""
        cache_of = getattr(self.core.runner, "grammar_cache", None)
        if cache_of is None:
            if self._grammar_cache is None:
                from pdcluster.engine.structured_output import GrammarCompilerCache

                self._grammar_cache = GrammarCompilerCache.from_tokenizer(
                    self.tokenizer, self.config.model.vocab_size, list(self.tokenizer.eos_token_ids))
            cache_of = lambda: self._grammar_cache  # noqa: E731
        assert params.structured_outputs is not None
        cache_of().compile(params.structured_outputs)

    def add_prepared(self, request: Request, prompt_text: str | None) -> None:
        self.output_processor.add_request(request.request_id, prompt_text, request.prompt_token_ids,
                                          request.sampling_params,
                                          prior_output_token_ids=request.output_token_ids,
                                          continues_elsewhere=request.kv_transfer_params is not None
                                          and request.kv_transfer_params.do_remote_decode)
        self.core.add_request(request)
        if self.ec is not None:
            self.ec.on_added(request)

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        req, text = self.prepare_request(prompt, params, request_id)
        self.add_prepared(req, text)
        return req.request_id

    def drop_unadmitted(self, request_id: str, kv_transfer_params: KVTransferParams) -> None:
        """A request with these params will never be added (its caller went away first, or it was
        refused before a Request existed): the connector hears it finished, so a producer's
        hand-off is let go now (Scheduler.drop_unadmitted)."""
        req = Request(request_id, [], SamplingParams(), kv_transfer_params=kv_transfer_params)
        self.core.scheduler.drop_unadmitted(req)

    def abort(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)
        for request_id in request_ids:
            self.output_processor.abort_request(request_id)
        if self.ec is not None:
            self.ec.on_aborted(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        core_outputs: list[EngineCoreOutput] = self.core.step()
        outputs, stopped = self.output_processor.process(core_outputs)
        if stopped:
            # A stop string matched in the text: the scheduler still thinks it is running.
            self.core.finish_stopped(stopped)
        if self.ec is not None:
            self.ec.on_outputs(outputs)
        return outputs

    def prepare_encode(self, images: Sequence[Any]) -> list[Any]:
        """encode()'s preprocessing (thread-safe): the distinct images as MultiModalFeatures."""
        if self.mm_processor is None:
            raise ValueError(f"encode: model {self.config.model.architecture} takes no images")
        return EngineEC.prepare_encode(self.mm_processor, images)

    def encode_prepared(self, request_id: str, features: list[Any]) -> ECTransferParams:
        """Run the tower on features (engine-local cache first), hold the outputs in the EC producer
        and return its params (one item per distinct image, each under a lease). Engine thread."""
        if self.ec is None:
            raise ValueError("encode: this engine has no EC connector (ec_connector)")
        return self.ec.encode(validate_request_id(request_id), features)

    def get_final(self, request_id: str) -> RequestOutput:
        return self.output_processor.get_final(request_id)

    def get_stats(self) -> dict[str, Any]:
        stats = self.core.get_stats()
        mm = getattr(self.core.runner, "mm", None)  # a multimodal model's embedder (mm_embedder.py)
        if mm is not None:
            s = mm.encoder_cache.stats
            stats.update({"mm_items_computed": s.num_encoded, "mm_items_local_cache": s.hits,
                          "encoder_cache_entries": s.num_entries, "encoder_cache_bytes": s.nbytes,
                          "encoder_cache_evictions": s.evictions})
        if self.ec is not None:
            stats["ec_connector"] = self.ec.stats()
        return stats

    def shutdown(self) -> None:
        """Release the KV and EC connectors' resources (transfer agents, shared memory). Idempotent."""
        if self.ec is not None:
            self.ec.shutdown()
            self.ec = None
        self.core.shutdown()


def check_prior_tokens(token_ids: Sequence[int] | None, params: SamplingParams, num_prompt_tokens: int,
                       config: EngineConfig) -> list[int]:
    if not token_ids:
        return []
    out = list(token_ids)
    vocab = config.model.vocab_size
    for i, t in enumerate(out):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            raise ValueError(f"prefill_output_token_ids[{i}] = {t!r} is not a token id in [0, {vocab})")
    if len(out) >= params.max_tokens:
        raise ValueError(f"prefill_output_token_ids has {len(out)} tokens and max_tokens={params.max_tokens}: "
                         "nothing is left to decode")
    if num_prompt_tokens + len(out) >= config.scheduler.max_model_len:
        raise ValueError(f"prompt plus prefill_output_token_ids is {num_prompt_tokens + len(out)} tokens; "
                         f"it must be shorter than max_model_len={config.scheduler.max_model_len}")
    return out
