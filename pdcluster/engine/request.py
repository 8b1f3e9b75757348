"""Request: the engine-side state of one generation request (owned by the scheduler).

Request states (RequestStatus) and the Scheduler calls that move them:

                      schedule(): the connector matches tokens asynchronously
                 +--------------------------------------------------------+
                 |                                                        v
  add_request -> WAITING <--- update(): finished_recving ---- WAITING_FOR_REMOTE_KV
                 |  ^          (num_computed = loaded tokens)   (blocks allocated; never scheduled)
      schedule():|  | PREEMPTED: back at the FRONT of the waiting queue; re-admitted with
      admitted   |  | prefix hits, it resumes as a NewRequestData carrying its output tokens
                 v  |
              RUNNING   schedule(): out of blocks -> the newest running request is PREEMPTED
                 |      (its blocks freed, num_computed_tokens = 0: recompute); update() does the
                 |      same to one whose loaded blocks failed under policy "recompute"
                 v
              FINISHED_STOPPED   eos (unless ignore_eos) or stop_token_ids, once min_tokens reached
              FINISHED_LENGTH    max_tokens or max_model_len
              FINISHED_ABORTED   finish_requests(), from any unfinished state
              FINISHED_ERROR     can never fit the cache, or KV transfer failed under policy "fail"

Blocks are freed when a request finishes, except: the connector's request_finished said
delay_free (freed when finished_sending reports it), or a load was still in flight (freed when
finished_recving reports it).
"""

from __future__ import annotations

import enum
import time

from pdcluster.engine.ec_transfer_params import ECTransferParams
from pdcluster.engine.kv_transfer_params import KVTransferParams
from pdcluster.engine.mm_inputs import MultiModalFeature
from pdcluster.engine.outputs import SampleLogprobs
from pdcluster.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    # Blocks are allocated and a connector is loading their KV from a remote producer; the
    # request is not scheduled until the connector reports the load finished (or failed).
    WAITING_FOR_REMOTE_KV = 1
    RUNNING = 2
    PREEMPTED = 3
    # Everything above PREEMPTED is finished.
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7

    @property
    def finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        """vLLM/OpenAI finish_reason string, or None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """Token-level state of a request. Text-level state (detokenizer, stop strings) lives in the
    output processor; block-level state lives in the KV cache manager, keyed by request_id."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        arrival_time: float | None = None,
        kv_transfer_params: KVTransferParams | None = None,
        output_token_ids: list[int] | None = None,
        mm_features: list[MultiModalFeature] | None = None,
    ) -> None:
        """output_token_ids: tokens already generated elsewhere (a decode leg starts with the
        prefill leg's sampled token); they count against max_tokens and are never re-emitted.
        mm_features: the prompt's images (engine/mm_inputs.py), in placeholder order."""
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = tuple(eos_token_ids)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.output_token_ids: list[int] = list(output_token_ids or ())
        self.status = RequestStatus.WAITING
        # Tokens whose KV is in the cache (computed locally, hit in the prefix cache, or loaded).
        self.num_computed_tokens = 0
        # Prompt tokens served from the local prefix cache or a connector when first scheduled.
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # Chained hashes of the request's full blocks (filled by the KV cache manager).
        self.block_hashes: list[bytes] = []
        self.kv_transfer_params = kv_transfer_params
        self.mm_features: list[MultiModalFeature] = list(mm_features or ())
        # Producers holding encoder outputs of these images (engine/ec_connector.py); the EC fetch
        # happens before the request reaches the scheduler (AsyncEngine.generate).
        self.ec_transfer_params: tuple[ECTransferParams, ...] = ()
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.first_token_time: float | None = None
        # SamplingParams.prompt_logprobs: entries for prompt tokens 1.. as prefill chunks score
        # them (engine/prompt_logprobs.py), until they go out with the first tokens (then None).
        self.prompt_logprobs: list[SampleLogprobs] | None = (
            [] if sampling_params.prompt_logprobs is not None and not self.output_token_ids else None)

    @property
    def prompt_logprobs_pending(self) -> bool:
        """Prompt logprobs still to compute and send: every prompt position must then be computed
        here (no prefix cache, no loaded KV)."""
        return self.prompt_logprobs is not None

    def add_prompt_logprobs(self, first: int, entries: list[SampleLogprobs]) -> None:
        """Entries for prompt tokens first, first + 1, ...; positions already held (a prompt
        recomputed after a preemption) are kept from the first time."""
        held = self.prompt_logprobs
        if held is None:
            return
        have = len(held) + 1  # the next prompt token without an entry (token 0 never has one)
        if first > have:
            raise RuntimeError(f"request {self.request_id!r}: prompt logprobs from token {first}, "
                               f"but only tokens up to {have - 1} have entries")
        held.extend(entries[have - first:])

    def take_prompt_logprobs(self) -> list[SampleLogprobs] | None:
        """The whole list, once (with the first tokens); None when not asked or already sent."""
        held, self.prompt_logprobs = self.prompt_logprobs, None
        return held

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
                f"output={self.num_output_tokens}, computed={self.num_computed_tokens})")
