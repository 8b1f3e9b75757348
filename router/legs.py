"""LegRunner: run one leg of a request on one worker of a pool, retrying on another worker while
the client has seen nothing.

    pick (policy over healthy workers of the pool, minus those already tried)
      -> Worker.Generate with the request's remaining deadline
      -> yield deltas until finished
    a worker-side failure -> tell the registry (UNAVAILABLE ejects at once) -> next worker,
    unless state.sent_to_client, the retry budget is spent or the deadline has passed
    (after output the orchestrator may migrate the request instead: migration.py; for that a
    worker's final ERROR delta is raised as a RouterError once output was sent)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Collection, Sequence

import grpc

from pdcluster._proto import common_pb2, worker_pb2
from pdcluster.handoff_trace import trace

from .config import RouterConfig
from .errors import RouterError, leg_failure, unavailable, worker_verdict
from .metrics import RouterMetrics
from .policies import RouteRequest, RoutingPolicy
from .registry import WorkerHandle, WorkerRegistry
from .request_state import RequestState

log = logging.getLogger(__name__)

# Failures that say "this worker cannot serve now", not "this request is bad": try another.
_RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                        grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.ABORTED})
# Failures that count against the worker's circuit breaker; UNAVAILABLE ejects at once.
_WORKER_FAULTS = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})


def continuation_params(params: common_pb2.SamplingParams) -> common_pb2.SamplingParams:
    """The sampling params of a leg that continues after tokens the client already has (a decode
    leg, a migrated leg): prompt logprobs went out with the first token, from the leg that computed
    the prompt, and a worker refuses them on a leg that does not compute it."""
    if not params.HasField("prompt_logprobs"):
        return params
    out = common_pb2.SamplingParams()
    out.CopyFrom(params)
    out.ClearField("prompt_logprobs")
    return out


def first_delta(request_id: str, last: worker_pb2.WorkerGenerateResponse) -> worker_pb2.WorkerGenerateResponse:
    """What the client gets of a prefill leg's answer before the decode leg goes on: its token(s)
    with their text, logprobs and the prompt's logprobs (the final fields come from the decode leg)."""
    return worker_pb2.WorkerGenerateResponse(request_id=request_id, token_ids=last.token_ids, text=last.text,
                                             logprobs=last.logprobs, prompt_logprobs=last.prompt_logprobs,
                                             token_arrival_times=last.token_arrival_times)


def check_prefill(last: worker_pb2.WorkerGenerateResponse | None) -> worker_pb2.WorkerGenerateResponse:
    """The prefill leg's last response, or the RouterError that it failed."""
    if last is not None and last.finish_reason == common_pb2.FINISH_REASON_ERROR and last.error_field:
        raise leg_failure(last.error_message, last.error_field)  # the request's own fault: a 400
    if last is None or last.finish_reason == common_pb2.FINISH_REASON_ERROR:
        raise RouterError(grpc.StatusCode.INTERNAL,
                          f"prefill leg failed: {last.error_message if last else 'no response'}")
    return last


def prefill_tokens(wreq: worker_pb2.WorkerGenerateRequest) -> int:
    """The prompt tokens a leg has its worker compute (its share of the worker's prefill backlog):
    the whole prompt, and the output sent so far for a resumed request; none for a decode leg that
    loads its KV. A cached prefix counts too: the router cannot know what stays cached."""
    if wreq.await_kv_transfer_id or (wreq.HasField("kv_transfer_params")
                                     and wreq.kv_transfer_params.do_remote_prefill):
        return 0
    return len(wreq.prompt_token_ids) + len(wreq.prefill_output_token_ids)


class LegRunner:
    def __init__(self, config: RouterConfig, registry: WorkerRegistry, policy: RoutingPolicy,
                 metrics: RouterMetrics) -> None:
        self.config = config
        self.registry = registry
        self.policy = policy
        self.metrics = metrics
        self._block_size: int | None = None  # the workers' KV block size, once one reported it

    async def run_prefill(self, state: RequestState, wreq: worker_pb2.WorkerGenerateRequest
                          ) -> worker_pb2.WorkerGenerateResponse | None:
        """A disaggregated request's prefill leg run to its last response (None: it sent none),
        traced and timed (`prefill_leg`); both disaggregation flows start with it."""
        request_id = state.prep.request_id
        started = time.monotonic()
        last = None
        trace("r.prefill_sent", request_id)
        async for resp in self.run(state, ("prefill",), wreq, leg="prefill"):
            last = resp
        trace("r.prefill_done", request_id)
        self.metrics.prefill_leg.observe(time.monotonic() - started)
        return last

    async def run(self, state: RequestState, roles: Sequence[str], wreq: worker_pb2.WorkerGenerateRequest,
                  *, leg: str, exclude: Collection[str] = ()) -> AsyncIterator[worker_pb2.WorkerGenerateResponse]:
        """exclude: addresses not to pick (workers this request already failed on)."""
        tried: set[str] = set(exclude)
        last_error = ""
        while True:
            handle = self.pick(state, roles, tried)
            if handle is None:
                if tried:
                    raise unavailable(f"no other {'/'.join(roles)} worker to retry on after {len(tried)} "
                                      f"failed; last error: {last_error}")
                raise unavailable(f"no healthy worker with role {'/'.join(roles)} is available")
            tried.add(handle.address)
            timeout = state.prep.remaining()
            if timeout is not None and timeout <= 0:
                raise RouterError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded before a worker was called")
            if state.aborted:
                raise RouterError(grpc.StatusCode.CANCELLED, "request aborted")
            self._record_route(state, handle, leg)
            call = handle.client.generate(wreq, timeout)
            state.touch(handle, call)
            handle.num_inflight += 1
            backlog = prefill_tokens(wreq)
            handle.prefill_backlog += backlog
            finished = False
            try:
                # read() rather than `async for`: grpc's iterator is an async generator that, left
                # unexhausted after the final delta, costs a finalizer task per request.
                while (resp := await call.read()) is not grpc.aio.EOF:
                    handle.prefill_backlog -= backlog  # the first response: the prompt is computed
                    backlog = 0
                    finished = resp.finished
                    if (finished and resp.finish_reason == common_pb2.FINISH_REASON_ERROR and not resp.error_field
                            and self._migrating(state)):
                        # The worker failed the request mid-way (a failed step, a lost KV pull):
                        # the orchestrator resumes it elsewhere, maybe on this same worker. Not a
                        # request that failed itself (error_field): it would fail there too.
                        raise RouterError(grpc.StatusCode.INTERNAL,
                                          f"worker {handle.worker_id} failed: {resp.error_message}")
                    yield resp
                    if finished:
                        self.registry.report_success(handle)
                        return
                state.failed_workers.add(handle.address)
                raise RouterError(grpc.StatusCode.INTERNAL,
                                  f"worker {handle.worker_id} closed the stream without a final response")
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if state.stalled != handle.address or (task is not None and task.cancelling()):
                    raise
                # The stall watch (migration.StallWatch) cancelled this leg, not the client.
                state.failed_workers.add(handle.address)
                self.registry.report_failure(handle, fatal=False, reason="stalled")
                raise RouterError(grpc.StatusCode.UNAVAILABLE, f"worker {handle.worker_id} sent nothing for "
                                  f"{self.config.stall_timeout_s:g}s") from None
            except grpc.aio.AioRpcError as e:
                if e.code() in _WORKER_FAULTS:
                    state.failed_workers.add(handle.address)
                err = self._worker_error(handle, e)
                last_error = err.message
                if not self._may_retry(state, e.code(), len(tried)):
                    raise err from None
                state.route.num_retries += 1
                self.metrics.retries.labels(leg).inc()
                log.info("request %s: %s leg failed on %s (%s); retrying on another worker",
                         state.request_id, leg, handle.address, e.code().name)
            finally:
                handle.num_inflight -= 1
                handle.prefill_backlog -= backlog
                state.active_calls.pop(handle.address, None)
                if not finished and not call.done():
                    call.cancel()  # cancelled, abandoned or failed: the worker stops now

    def _migrating(self, state: RequestState) -> bool:
        return state.sent_to_client and self.config.max_migrations > 0 and not state.aborted

    def _may_retry(self, state: RequestState, code: grpc.StatusCode, num_tried: int) -> bool:
        if state.sent_to_client or state.aborted or code not in _RETRYABLE:
            return False
        if num_tried > self.config.max_retries:
            return False
        remaining = state.prep.remaining()
        return remaining is None or remaining > 0

    def _worker_error(self, handle: WorkerHandle, e: grpc.aio.AioRpcError) -> RouterError:
        code = e.code()
        if code in _WORKER_FAULTS:
            self.registry.report_failure(handle, fatal=code == grpc.StatusCode.UNAVAILABLE,
                                         reason=f"{code.name}: {e.details()}")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return RouterError(code, "deadline exceeded")
        if code in _WORKER_FAULTS:
            return RouterError(grpc.StatusCode.UNAVAILABLE, f"worker {handle.worker_id} failed: {code.name}: "
                               f"{e.details()}")
        # The worker's verdict on the request itself (INVALID_ARGUMENT, ...) reaches the client.
        return worker_verdict(code, e.details() or code.name)

    @staticmethod
    def _record_route(state: RequestState, handle: WorkerHandle, leg: str) -> None:
        state.leg_address[leg] = handle.address
        if leg == "prefill":
            state.route.prefill_worker_id = handle.worker_id
        else:
            state.route.decode_worker_id = handle.worker_id

    # -- picking --------------------------------------------------------------------------------
    def pick(self, state: RequestState, roles: Sequence[str], exclude: set[str]) -> WorkerHandle | None:
        handles = [h for h in self.registry.candidates(roles) if h.address not in exclude]
        if len(handles) <= 1:
            return handles[0] if handles else None
        by_address = {h.address: h for h in handles}
        route = RouteRequest(state.request_id, state.prep.prompt_token_ids, self.block_hashes(state),
                             mm_offset=state.prep.mm_offset)
        view = self.policy.pick(route, [h.view() for h in handles], {h.worker_id: h.load() for h in handles})
        return None if view is None else by_address.get(view.address)

    def block_size(self) -> int | None:
        """The workers' KV block size (learned once: every worker of one model shares it)."""
        if self._block_size is None:
            info = self.registry.first_info()
            if info is not None and info.block_size:
                self._block_size = info.block_size
        return self._block_size

    def block_hashes(self, state: RequestState) -> list[bytes] | None:
        """The prompt's chained block hashes (once per request), when the policy routes by them."""
        if state.block_hashes is None:
            block_size = self.block_size()
            if block_size is None:
                return None
            params = state.prep.sampling_params
            route = RouteRequest(state.request_id, state.prep.prompt_token_ids, mm_offset=state.prep.mm_offset,
                                 cache_salt=params.cache_salt if params.HasField("cache_salt") else None)
            hashes = self.policy.block_hashes(route, block_size)
            if hashes is None:
                return None
            state.block_hashes = list(hashes)
        return state.block_hashes
