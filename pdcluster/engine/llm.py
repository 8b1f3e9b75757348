"""The offline API, shaped like vLLM's `LLM` because that is what users know."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdcluster.config import EngineArgs
from pdcluster.engine.llm_engine import LLMEngine
from pdcluster.engine.outputs import RequestOutput
from pdcluster.generation_defaults import load_generation_defaults
from pdcluster.sampling_params import SamplingParams, sibling_seed

# A text prompt, token ids, or vLLM's dict {"prompt": str, "multi_modal_data": {"image": ...}}.
PromptType = str | Sequence[int] | dict[str, Any]


class LLM:
    """`LLM(model=PATH, dtype="auto", block_size=16, max_model_len=None, max_num_seqs=64,
    max_num_batched_tokens=None, enable_prefix_caching=True, kv_cache_memory_bytes=None, ...)`.
    `model=None` uses the built-in demo model. Unknown options raise ValueError.
    With `kv_connector=NAME`, pass `connector=pdcluster.connectors.engine_connector_factory`."""

    def __init__(self, model: str | None = None, *, connector: Any = None, generation_config: str = "auto",
                 **kwargs: Any) -> None:
        self.engine = LLMEngine.from_engine_args(EngineArgs.from_kwargs(model=model, **kwargs), connector=connector)
        # vLLM's generation_config: the checkpoint's sampling defaults (pdcluster/generation_defaults.py).
        self.generation_defaults = load_generation_defaults(generation_config, self.engine.config.model.model_path)

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() and chat() use when given no SamplingParams: the checkpoint's
        generation_config.json defaults over SamplingParams' own (vLLM's method)."""
        d = self.generation_defaults
        return SamplingParams(**d.sampling, **({"max_tokens": d.max_tokens} if d.max_tokens is not None else {}))

    @property
    def num_kv_blocks(self) -> int:
        """Blocks in the KV cache (per TP rank): the memory budget over one block's bytes, so an fp8
        cache holds twice the blocks of a bfloat16 one (four times float32's) in the same budget."""
        return self.engine.config.cache.num_blocks

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (false while a running request holds blocks)."""
        return self.engine.core.scheduler.reset_prefix_cache()

    def collective_stats(self) -> dict[str, float]:
        """Tensor parallel only: rank 0's cumulative collective counts and times."""
        return self.engine.core.runner.collective_stats()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (strings, lists of token ids, or dicts with "prompt" or
        "prompt_token_ids" and optional "multi_modal_data": {"image": PIL image or a list} and
        "cache_salt"); outputs in prompt order. Every prompt is validated before any is scheduled,
        so a bad one rejects the batch early.

        `n` > 1 runs n sequences of the prompt as n engine requests (the later ones find the
        prompt's blocks in the prefix cache) and returns them as one RequestOutput's `outputs`,
        index 0..n-1; with a seed, sequence j samples with seed + j, as the HTTP frontend does.
        priority: one per prompt (lower first), for an engine built with
        scheduling_policy="priority"."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or self.get_default_sampling_params()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"sampling_params has {len(params_list)} entries for {len(prompt_list)} prompts")
        if priority is not None:  # vLLM's per-prompt list (--scheduling-policy priority)
            if len(priority) != len(prompt_list):
                raise ValueError(f"priority has {len(priority)} entries for {len(prompt_list)} prompts")
            params_list = [sp.replace(priority=p) for sp, p in zip(params_list, priority)]
        groups = [self._prepare(p, sp) for p, sp in zip(prompt_list, params_list)]
        for group in groups:
            for req, text in group:
                self.engine.add_prepared(req, text)
        pending = {req.request_id for group in groups for req, _ in group}
        while pending:
            for out in self.engine.step():
                if out.finished:
                    pending.discard(out.request_id)
        return [self._merged([self.engine.get_final(req.request_id) for req, _ in group]) for group in groups]

    def _prepare(self, prompt: PromptType, params: SamplingParams) -> list[Any]:
        """The prompt's engine requests: one per sequence of `n`."""
        mm_data = None
        if isinstance(prompt, dict):
            prompt, mm_data, salt = _unpack(prompt)
            if salt is not None:
                params = params.replace(cache_salt=salt)
        return [self.engine.prepare_request(prompt, sibling_params(params, j), multi_modal_data=mm_data)
                for j in range(params.n)]

    @staticmethod
    def _merged(outs: list[RequestOutput]) -> RequestOutput:
        first = outs[0]
        for j, out in enumerate(outs[1:], start=1):
            seq = out.outputs[0]
            seq.index = j
            first.outputs.append(seq)
        return first

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """vLLM's LLM.chat: one conversation (a list of messages) or several, each rendered with
        the chat template and generated; one RequestOutput per conversation."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts: list[Any] = [tok.apply_chat_template(
            list(conv), add_generation_prompt, True, tools=tools, chat_template=chat_template,
            continue_final_message=continue_final_message, **(chat_template_kwargs or {})) for conv in convs]
        return self.generate(prompts, sampling_params)


_PROMPT_KEYS = ("cache_salt", "multi_modal_data", "prompt", "prompt_token_ids")


def _unpack(prompt: dict[str, Any]) -> tuple[Any, Any, Any]:
    """vLLM's prompt dict -> (prompt, multi_modal_data, cache_salt)."""
    unknown = sorted(set(prompt) - set(_PROMPT_KEYS))
    if unknown:
        raise ValueError(f"prompt dict: unknown key(s) {unknown}; known: {list(_PROMPT_KEYS)}")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError("prompt dict needs exactly one of 'prompt' and 'prompt_token_ids'")
    return (prompt.get("prompt", prompt.get("prompt_token_ids")), prompt.get("multi_modal_data"),
            prompt.get("cache_salt"))


def sibling_params(params: SamplingParams, j: int) -> SamplingParams:
    """Sequence j of a request for n sequences: one engine request, seeded with sibling_seed."""
    if params.n == 1:
        return params
    seed = None if params.seed is None else sibling_seed(params.seed, j)
    return params.replace(n=1, seed=seed)


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # one prompt given as token ids
    return list(prompts)
