"""LLMEngine: EngineCore plus the text layer (tokenizer, input validation, detokenization, stop
strings). Single-threaded: LLM drives it directly and AsyncEngine drives it from one thread."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any

from pdcluster.config import EngineArgs, EngineConfig
from pdcluster.engine.engine_core import EngineCore
from pdcluster.engine.input_processor import process_prompt, validate_request_id
from pdcluster.engine.outputs import EngineCoreOutput, RequestOutput
from pdcluster.engine.request import Request
from pdcluster.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, connector: Any = None) -> None:
        from pdcluster.engine.output_processor import OutputProcessor
        from pdcluster.engine.tokenizer import Tokenizer

        self.config = config
        self.tokenizer = Tokenizer.from_pretrained(config.tokenizer_path)
        self.core = EngineCore(config, connector=connector)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, connector: Any = None) -> LLMEngine:
        return cls(args.create_engine_config(), connector=connector)

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
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> tuple[Request, str | None]:
        """Validate and tokenize (thread-safe, touches no engine state). Raises ValueError."""
        params = params if params is not None else SamplingParams()
        request_id = validate_request_id(request_id if request_id is not None else self.new_request_id())
        text, ids = process_prompt(prompt, params, self.tokenizer, self.config.model.vocab_size,
                                   self.config.scheduler.max_model_len)
        req = Request(request_id, ids, params, eos_token_ids=self.eos_token_ids,
                      kv_transfer_params=kv_transfer_params)
        return req, text

    def add_prepared(self, request: Request, prompt_text: str | None) -> None:
        self.output_processor.add_request(request.request_id, prompt_text, request.prompt_token_ids,
                                          request.sampling_params)
        self.core.add_request(request)

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        req, text = self.prepare_request(prompt, params, request_id)
        self.add_prepared(req, text)
        return req.request_id

    def abort(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)
        for rid in request_ids:
            self.output_processor.abort_request(rid)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        core_outputs: list[EngineCoreOutput] = self.core.step()
        outputs, stopped = self.output_processor.process(core_outputs)
        if stopped:
            # A stop string matched in the text: the scheduler still thinks it is running.
            self.core.finish_stopped(stopped)
        return outputs

    def get_final(self, request_id: str) -> RequestOutput:
        return self.output_processor.get_final(request_id)

    def get_stats(self) -> dict[str, Any]:
        return self.core.get_stats()
