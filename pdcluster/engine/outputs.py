"""The dataclasses at the engine's internal boundaries, one per direction:

    Scheduler.schedule() -> SchedulerOutput -> ModelRunner.execute() -> ModelRunnerOutput
        -> Scheduler.update() -> list[EngineCoreOutput] -> OutputProcessor -> RequestOutput

SchedulerOutput must stay plain data (ints, lists, strings, SamplingParams): with tensor
parallelism rank 0 serialises it (msgpack) and broadcasts it to the other ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdcluster.engine.ec_transfer_params import ECTransferParams
from pdcluster.engine.kv_transfer_params import KVTransferParams
from pdcluster.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the model runner has no state for: first scheduled, or resumed after preemption
    (then output_token_ids is not empty and everything is recomputed from num_computed_tokens)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_ids: tuple[int, ...] = ()
    # The prompt's images (mm_inputs.MultiModalFeature: pixels, placeholder range, mm_hash).
    mm_features: list[Any] = field(default_factory=list)


@dataclass
class CachedRequestData:
    """A request the model runner already holds; only its new blocks and progress are sent."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    # request_id -> number of tokens computed for it this step (prefill chunk or 1 for decode)
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests whose runner-side state must be dropped (finished, aborted or preempted).
    finished_request_ids: set[str] = field(default_factory=set)
    # Opaque per-step metadata built by the KV connector's scheduler side.
    kv_connector_metadata: Any = None
    # Speculative decoding: request_id -> draft tokens scheduled after its last token (they are
    # counted in num_scheduled_tokens; the runner keeps those the model agrees with).
    scheduled_spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # A load-first step (SchedulerConfig.kv_load_wait_s): it only starts these requests' loads,
    # and the engine waits for them before the next step.
    load_first: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class Logprob:
    token_id: int
    logprob: float
    rank: int  # 1 = most likely


@dataclass
class SampleLogprobs:
    """Logprob of the sampled token plus the top-n alternatives (n = SamplingParams.logprobs)."""

    sampled: Logprob
    top: list[Logprob]


@dataclass(frozen=True)
class RequestFault:
    """A request that cannot go on because of what it asked for, not because anything failed:
    its structured-output grammar, allowed_token_ids or min_tokens leave no token of the
    vocabulary to sample. It ends with finish_reason "error" naming `field`, and the router
    neither migrates nor retries it (another worker would reach the same point)."""

    field: str
    message: str


@dataclass
class ModelRunnerOutput:
    request_ids: list[str]
    # One list per request in request_ids order; empty for a request whose prompt chunk did not
    # reach the end of its known tokens this step (nothing sampled). More than one token when
    # drafts were accepted (speculative decoding): the accepted drafts, then the model's next.
    sampled_token_ids: list[list[int]]
    # Per request, one entry per sampled token when the request asked for logprobs, else [].
    logprobs: list[list[SampleLogprobs]] = field(default_factory=list)
    # Request id -> (index of the first prompt token scored, its entries): prompt_logprobs.py.
    prompt_logprobs: dict[str, tuple[int, list[SampleLogprobs]]] = field(default_factory=dict)
    # Filled by the worker side of a KV connector.
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    # Requests whose own constraints left no token to sample this step: they end with an error.
    faults: dict[str, RequestFault] = field(default_factory=dict)


@dataclass
class EngineCoreOutput:
    """Per-request token-level delta from one engine step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[SampleLogprobs] = field(default_factory=list)
    # With the first tokens of a request that asked: one entry per prompt token after the first.
    prompt_logprobs: list[SampleLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    error: str | None = None
    error_field: str | None = None  # with error: the request field at fault (RequestFault)
    kv_transfer_params: KVTransferParams | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[SampleLogprobs] | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    """What `LLM.generate` returns per prompt and `AsyncEngine.generate` yields per step.

    From AsyncEngine each yield is a delta: `outputs[0].text` / `token_ids` hold only what is new
    since the previous yield. From LLM.generate it is the whole result.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    kv_transfer_params: KVTransferParams | None = None
    error: str | None = None
    error_field: str | None = None  # with error: the request field at fault (RequestFault)
    metrics: dict[str, float] = field(default_factory=dict)
    # SamplingParams.prompt_logprobs: one entry per prompt token after the first (sampled = that
    # token, with its rank), in the delta that carries the first tokens and in the whole result.
    prompt_logprobs: list[SampleLogprobs] | None = None
    # Final output only: encoder outputs of this request's images that this engine's EC producer
    # now holds under leases for other instances (engine/ec_connector.py).
    ec_transfer_params: ECTransferParams | None = None
