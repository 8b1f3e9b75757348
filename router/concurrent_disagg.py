"""Concurrent disaggregation (`--disagg-mode concurrent`, DESIGN.md section 3): both legs at once.

    router assigns a transfer_id (32 hex)
    -> prefill worker:  Generate(prompt, max_tokens=1, kv={do_remote_decode, transfer_id})
    -> decode worker:   Generate(prompt, await_kv_transfer_id=transfer_id)      (same moment)
         the decode worker checks, tracks and prepares its leg while the prefill runs; the
         engine request waits unscheduled (worker/kv_params_wait.py)
    prefill returns t0 + kv_transfer_params (bound to this request and transfer_id)
    -> decode worker:   ProvideKVParams(request_id, transfer_id, params, [t0])  (router only)
    -> client: t0, then the decode leg's deltas (pull, t1, t2, ...) as in sequential mode

So the decode leg's gRPC hop, admission and preparation leave the hand-off path; the pull still
starts when the params exist. Output equals sequential (and aggregated) token for token: the
decode leg is the same request, it only gets its params and t0 later.

Failures: a prefill leg that fails (after its own retries), ends the request on t0, or is aborted
closes the waiting decode leg, whose worker drops it (it never held blocks); the request's close
aborts on every touched worker as in sequential mode. A decode leg that is gone or refuses the
params before it had them (a retry moved it, its worker restarted) is closed and the hand-off
goes on in sequential mode with the params in hand. The decode worker bounds the wait
(disagg_params_timeout_s: DEADLINE_EXCEEDED, a clear message). Multimodal requests, and requests
for one token, take the sequential flow.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Protocol

import grpc

from pdcluster._proto import common_pb2, worker_pb2
from pdcluster.handoff_trace import trace

from .config import RouterConfig
from .errors import RouterError
from .legs import LegRunner, check_prefill, continuation_params, first_delta
from .metrics import RouterMetrics
from .request_state import RequestState


class Orchestrator(Protocol):
    """What this flow uses of router/orchestrator.Orchestrator (which imports this module)."""

    config: RouterConfig
    legs: LegRunner
    metrics: RouterMetrics

    def _abort_on_workers(self, request_id: str, handles: Sequence) -> None: ...

log = logging.getLogger(__name__)
_PROVIDE_TIMEOUT_S = 5.0


def applies(state: RequestState) -> bool:
    prep = state.prep
    wanted = prep.sampling_params.max_tokens if prep.sampling_params.HasField("max_tokens") else 16
    return wanted > 1 and not prep.images


async def run(orch: Orchestrator, state: RequestState) -> AsyncIterator[worker_pb2.WorkerGenerateResponse]:
    prep = state.prep
    orch.metrics.disaggregated.inc()
    transfer_id = uuid.uuid4().hex
    prefill_params = common_pb2.SamplingParams()
    prefill_params.CopyFrom(prep.sampling_params)
    prefill_params.max_tokens = 1
    if prefill_params.HasField("min_tokens"):
        prefill_params.min_tokens = min(prefill_params.min_tokens, 1)  # EOS stays masked for t0
    wanted = prep.sampling_params.max_tokens if prep.sampling_params.HasField("max_tokens") else 16
    prefill = worker_pb2.WorkerGenerateRequest(
        request_id=prep.request_id, prompt_token_ids=prep.prompt_token_ids, sampling_params=prefill_params,
        stream=False)
    prefill.kv_transfer_params.do_remote_decode = True
    prefill.kv_transfer_params.transfer_id = transfer_id  # the producer binds its lease to it
    decode = worker_pb2.WorkerGenerateRequest(
        request_id=prep.request_id, prompt_token_ids=prep.prompt_token_ids,
        sampling_params=continuation_params(prep.sampling_params), stream=prep.stream, await_kv_transfer_id=transfer_id,
        kv_params_timeout_s=orch.config.disagg_params_timeout_s)
    trace("r.mode_concurrent", prep.request_id)
    trace("r.decode_sent", prep.request_id)
    decode_leg = orch.legs.run(state, ("decode",), decode, leg="decode")
    head = asyncio.ensure_future(anext(decode_leg))  # picks, sends and waits for the first delta
    handing: asyncio.Future | None = None
    try:
        last = check_prefill(await orch.legs.run_prefill(state, prefill))
        if state.aborted:
            raise RouterError(grpc.StatusCode.CANCELLED, "request aborted")
        state.route.disaggregated = True
        if last.finish_reason == common_pb2.FINISH_REASON_STOP or wanted <= len(last.token_ids):
            # Complete on t0: no decode leg; the waiting one is closed (finally), the held blocks aborted.
            if last.HasField("kv_transfer_params"):
                orch._abort_on_workers(prep.request_id, list(state.touched.values()))
            last.ClearField("kv_transfer_params")
            await _close(head, decode_leg)
            yield last
            return
        if last.HasField("kv_transfer_params"):
            orch.metrics.kv_transfer_tokens.inc(last.kv_transfer_params.num_tokens)
        # t0 is as good as sent from here (the sequential rule): no retry of the decode leg elsewhere.
        state.sent_to_client = True
        # The hand-over runs while the frontend writes t0 (it must not wait for the RPC's reply).
        handing = asyncio.ensure_future(_provide(orch, state, last, transfer_id, head))
        yield first_delta(prep.request_id, last)  # TTFT is the prefill leg's
        if not await handing:
            await _close(head, decode_leg)
            trace("r.concurrent_fallback", prep.request_id)
            decode_leg = orch.legs.run(state, ("decode",), _sequential_decode(state, last), leg="decode",
                                       exclude=state.failed_workers)
            head = asyncio.ensure_future(anext(decode_leg))
        resp = await head
    except BaseException:
        if handing is not None:
            handing.cancel()
            await asyncio.gather(handing, return_exceptions=True)
        await _close(head, decode_leg)
        raise
    while True:
        if resp.token_ids:
            trace("r.decode_token", prep.request_id)
        if resp.HasField("usage"):
            resp.usage.completion_tokens += len(last.token_ids)  # t0 came from the prefill leg
        yield resp
        try:
            resp = await anext(decode_leg)
        except StopAsyncIteration:
            return


async def _provide(orch: Orchestrator, state: RequestState, last: worker_pb2.WorkerGenerateResponse,
                   transfer_id: str, head: asyncio.Future) -> bool:
    """Hand the prefill's result to the waiting decode leg; False: it cannot take them (go sequential)."""
    if head.done():  # the decode leg ended (or failed) before it had its params
        return False
    address = state.leg_address.get("decode")
    handle = state.touched.get(address) if address else None
    if handle is None:
        return False
    req = worker_pb2.ProvideKVParamsRequest(request_id=state.request_id, transfer_id=transfer_id,
                                            prefill_output_token_ids=last.token_ids)
    if last.HasField("kv_transfer_params"):
        req.kv_transfer_params.CopyFrom(last.kv_transfer_params)
        req.kv_transfer_params.do_remote_decode = False
        req.kv_transfer_params.do_remote_prefill = True
    remaining = state.prep.remaining()
    trace("r.provide_sent", state.request_id)
    try:
        await handle.client.provide_kv_params(req, _PROVIDE_TIMEOUT_S if remaining is None
                                              else max(0.001, min(remaining, _PROVIDE_TIMEOUT_S)))
    except grpc.aio.AioRpcError as e:
        log.info("request %s: ProvideKVParams on %s failed (%s: %s); continuing in sequential mode",
                 state.request_id, address, e.code().name, e.details())
        return False
    return True


def _sequential_decode(state: RequestState, last: worker_pb2.WorkerGenerateResponse) -> worker_pb2.WorkerGenerateRequest:
    prep = state.prep
    decode = worker_pb2.WorkerGenerateRequest(request_id=prep.request_id, prompt_token_ids=prep.prompt_token_ids,
                                              sampling_params=continuation_params(prep.sampling_params),
                                              stream=prep.stream, prefill_output_token_ids=last.token_ids)
    if last.HasField("kv_transfer_params"):
        decode.kv_transfer_params.CopyFrom(last.kv_transfer_params)
        decode.kv_transfer_params.do_remote_decode = False
        decode.kv_transfer_params.do_remote_prefill = True
    return decode


async def _close(head: asyncio.Future, decode_leg: AsyncIterator) -> None:
    """Stop the decode leg: its finally cancels the worker call (the worker drops the waiting leg)."""
    head.cancel()
    await asyncio.gather(head, return_exceptions=True)
    await decode_leg.aclose()  # type: ignore[attr-defined]
