"""WorkerServicer: the pdcluster.v1.Worker gRPC service over one AsyncEngine.

One Generate call = one engine request. A pump task per request moves the engine's deltas into
a local queue; the RPC handler reads that queue. The indirection lets three things end a
request at any await, each freeing its KV blocks in the engine:

    client cancels / connection drops   grpc cancels the handler -> finally: cancel the pump
    the call's deadline passes          handler's own timer -> cancel the pump -> DEADLINE_EXCEEDED
    Abort RPC                           cancel the pump, queue _ABORTED -> final ABORT response

(cancelling the pump closes AsyncEngine.generate, whose finally aborts the request in the
engine). Errors before the first response are gRPC status codes; after it, a final response
with finish_reason ERROR.

GenerateStream (the router's path) runs many requests over one call with the same per-request
rules; see worker_stream.py. Both share check_request, refusal_for and response below.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import aclosing
from typing import Any

import grpc

from pdcluster import __version__
from pdcluster._proto import common_pb2, worker_pb2, worker_pb2_grpc
from pdcluster.engine.async_engine import EngineDeadError
from pdcluster.engine.outputs import RequestOutput
from pdcluster.sampling_params import SamplingParams
from pdcluster.worker import convert
from pdcluster.worker.inflight import Inflight, Refusal
from pdcluster.worker.roles import KvTransferRejected, RoleHandler
from pdcluster.worker.worker_stats import HitRateWindow, KVEventsInfo, build_info, build_stats
from pdcluster.worker.worker_stream import StreamSession

log = logging.getLogger(__name__)

_ABORTED = object()  # queued by Abort: end the stream with finish_reason ABORT


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, engine: Any, role: RoleHandler, *, worker_id: str, epoch: int,
                 kv_events: Any = None) -> None:
        """engine: AsyncEngine; kv_events: a KVEventService (None: publisher disabled)."""
        self.engine = engine
        self.role = role
        self.worker_id = worker_id
        self.epoch = epoch
        self.kv_events = kv_events
        # The model directory: routers load the tokenizer from it (client-facing names are theirs).
        self.model_name = engine.engine.config.model.model_path
        self._eos = frozenset(engine.engine.eos_token_ids)
        self._inflight: dict[str, Inflight] = {}
        self._sessions: set[StreamSession] = set()
        self._pumps: dict[str, asyncio.Task] = {}  # request id -> its pump task, until that ends
        self._hit_rate = HitRateWindow()

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    # -- Generate -------------------------------------------------------------------------------
    async def Generate(self, request: worker_pb2.WorkerGenerateRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id or self.engine.engine.new_request_id()
        try:
            params, kv = self.check_request(request, rid)
        except Refusal as r:
            await context.abort(r.code, r.message)
        inflight = Inflight(num_prompt_tokens=len(request.prompt_token_ids))
        self._inflight[rid] = inflight
        inflight.task = self.start_pump(rid, request, params, kv, inflight.queue.put_nowait)
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        collected: list[worker_pb2.WorkerGenerateResponse] = []
        try:
            while True:
                item = await self._next(inflight, deadline, context, sent=bool(collected) or inflight.num_tokens > 0)
                resp = self.response(rid, inflight, item, params)
                if request.stream:
                    yield resp
                else:
                    collected.append(resp)
                if resp.finished:
                    break
            if not request.stream:
                yield convert.merge_responses(collected)
        finally:
            # Runs on normal end, client cancellation (CancelledError) and abort alike.
            if inflight.task is not None and not inflight.task.done():
                inflight.task.cancel()
            if self._inflight.get(rid) is inflight:
                del self._inflight[rid]

    def check_request(self, request: worker_pb2.WorkerGenerateRequest,
                      rid: str) -> tuple[SamplingParams, dict | None]:
        """The request's sampling params and accepted KV params, or Refusal."""
        try:
            params = convert.sampling_params_from_proto(request.sampling_params)
            eos = request.eos_token_ids
            if eos and frozenset(eos) != self._eos:
                raise ValueError(f"eos_token_ids: overriding the model's EOS tokens {sorted(self._eos)} is not "
                                 "supported; send extra ones as sampling_params.stop_token_ids")
            kv = convert.kv_params_from_proto(request.kv_transfer_params) \
                if request.HasField("kv_transfer_params") else None
            kv = self.role.accept(kv)
        except ValueError as e:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        except KvTransferRejected as e:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None
        if rid in self._inflight:
            raise Refusal(grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is already running here")
        if not self.engine.is_healthy:
            raise Refusal(grpc.StatusCode.UNAVAILABLE, "engine is not running")
        return params, kv

    async def GenerateStream(self, request_iterator: Any, context: grpc.aio.ServicerContext):  # noqa: N802
        session = StreamSession(self)
        self._sessions.add(session)
        try:
            await session.serve(request_iterator, context)
        finally:
            self._sessions.discard(session)

    def start_pump(self, rid: str, request: worker_pb2.WorkerGenerateRequest, params: SamplingParams,
                   kv: dict | None, sink: Callable[[Any], bool | None]) -> asyncio.Task:
        """Run the request in the engine as a task that hands sink each (arrival time, output), or
        the exception that ended it, until the request ends or sink returns true. Cancelling the
        task closes AsyncEngine.generate, which aborts the request and frees its blocks.

        An aborted request with the same id may still be leaving the engine (its cancelled task has
        not finished): the new one starts after it, so a client that reuses an id right after a
        cancel is served, not refused as a duplicate."""
        previous = self._pumps.get(rid)
        if previous is not None and previous.done():
            previous = None
        task = asyncio.get_running_loop().create_task(self._pump(rid, request, params, kv, sink, previous))
        self._pumps[rid] = task
        task.add_done_callback(lambda t: self._pumps.pop(rid) if self._pumps.get(rid) is t else None)
        return task

    async def _pump(self, rid: str, request: worker_pb2.WorkerGenerateRequest, params: SamplingParams,
                    kv: dict | None, sink: Callable[[Any], bool | None], previous: asyncio.Task | None) -> None:
        if previous is not None:
            await asyncio.wait([previous])
        prior = list(request.prefill_output_token_ids)  # the decode leg's; the engine validates them
        try:
            async with aclosing(self.engine.generate(list(request.prompt_token_ids), params, request_id=rid,
                                                     kv_transfer_params=kv,
                                                     prefill_output_token_ids=prior or None)) as outputs:
                async for out in outputs:
                    if sink((time.time(), out)):
                        return
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # the receiver maps it to a status code
            sink(e)

    async def _next(self, inflight: Inflight, deadline: float | None, context: grpc.aio.ServicerContext,
                    sent: bool) -> Any:
        try:
            if deadline is None:
                item = await inflight.queue.get()
            else:
                item = await asyncio.wait_for(inflight.queue.get(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            # gRPC also cancels the handler at the deadline; this timer makes it certain and
            # frees the blocks now rather than at the next engine output.
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded; request aborted")
        refusal = self.refusal_for(item, sent)
        if refusal is not None:
            await context.abort(refusal.code, refusal.message)
        return item

    def refusal_for(self, item: Any, sent: bool) -> Refusal | None:
        """The status a pumped item ends the request with, if any: an exception from the engine,
        or an error output before anything was sent while the engine is down (the router then
        retries elsewhere). None: send the item as a delta."""
        if isinstance(item, BaseException):
            if isinstance(item, ValueError):
                return Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(item))
            if isinstance(item, EngineDeadError):
                return Refusal(grpc.StatusCode.UNAVAILABLE, str(item))
            log.error("request failed", exc_info=item)
            return Refusal(grpc.StatusCode.INTERNAL, f"internal error: {item!r}")
        if item is not _ABORTED:
            _, out = item
            if out.error and not sent and not self.engine.is_healthy:
                return Refusal(grpc.StatusCode.UNAVAILABLE, out.error)
        return None

    def response(self, rid: str, inflight: Inflight, item: Any,
                  params: SamplingParams) -> worker_pb2.WorkerGenerateResponse:
        if item is _ABORTED:
            return worker_pb2.WorkerGenerateResponse(
                request_id=rid, finished=True, finish_reason=common_pb2.FINISH_REASON_ABORT,
                usage=common_pb2.Usage(prompt_tokens=inflight.num_prompt_tokens,
                                       completion_tokens=inflight.num_tokens))
        arrival, out = item
        assert isinstance(out, RequestOutput)
        inflight.num_tokens += len(out.outputs[0].token_ids)
        token_text = self._token_text if params.logprobs is not None and params.detokenize else None
        return convert.output_to_response(out, arrival_time=arrival, num_completion_tokens=inflight.num_tokens,
                                          token_text=token_text)

    def _token_text(self, token_id: int) -> str:
        return self.engine.engine.tokenizer.decode([token_id], skip_special_tokens=False)

    # -- Abort, Stats, GetInfo --------------------------------------------------------------------
    async def Abort(self, request: common_pb2.AbortRequest, context: grpc.aio.ServicerContext) -> common_pb2.AbortResponse:
        aborted = []
        for rid in request.request_ids:
            if self.abort(rid):
                aborted.append(rid)
            else:
                # Not streaming here, but the engine may still hold its blocks (e.g. under a
                # transfer lease once connectors exist): abort there too; unknown ids are ignored.
                await self.engine.abort(rid)
        return common_pb2.AbortResponse(aborted_request_ids=aborted)

    def abort(self, rid: str) -> bool:
        inflight = self._inflight.get(rid)
        if inflight is None:
            return False
        if inflight.task is not None:
            inflight.task.cancel()  # closes AsyncEngine.generate -> engine abort, blocks freed
        if inflight.on_abort is not None:
            inflight.on_abort()
        else:
            inflight.queue.put_nowait(_ABORTED)
        return True

    def abort_all(self) -> int:
        """Shutdown: abort every request and end every GenerateStream once its replies are out."""
        num = sum(self.abort(rid) for rid in list(self._inflight))
        for session in self._sessions:
            session.close()
        return num

    def kv_events_info(self) -> KVEventsInfo:
        return self.kv_events.info() if self.kv_events is not None else KVEventsInfo()

    async def Stats(self, request: worker_pb2.StatsRequest, context: grpc.aio.ServicerContext) -> common_pb2.WorkerStats:
        stats = self.engine.get_stats()
        hit_rate = self._hit_rate.update(int(stats.get("prefix_cache_queries", 0)), int(stats.get("prefix_cache_hits", 0)))
        return build_stats(self.worker_id, self.role.proto_role, self.model_name,
                           self.engine.engine.config.cache.block_size, stats, self.kv_events_info(), hit_rate)

    async def GetInfo(self, request: worker_pb2.GetInfoRequest, context: grpc.aio.ServicerContext) -> worker_pb2.WorkerInfo:
        return build_info(self.worker_id, self.role.proto_role, self.engine.engine, self.epoch,
                          self.kv_events_info(), self.role.connector_name, __version__)
