"""WorkerServicer: the pdcluster.v1.Worker gRPC service over one AsyncEngine -- a thin adapter
from gRPC calls to the worker's RequestTable (request_table.py), which owns every request.

One Generate call = one engine request. A pump task per request moves the engine's deltas into
a local queue; the RPC handler reads that queue. The indirection lets three things end a
request at any await, each freeing its KV blocks in the engine:

    client cancels / connection drops   grpc cancels the handler -> finally: cancel the pump
    the call's deadline passes          handler's own timer -> cancel the pump -> DEADLINE_EXCEEDED
    Abort RPC                           cancel the pump, queue ABORTED -> final ABORT response

(cancelling the pump closes AsyncEngine.generate, whose finally aborts the request in the
engine). Errors before the first response are gRPC status codes; after it, a final response
with finish_reason ERROR.

ProvideKVParams (concurrent disaggregation, kv_params_wait.py) hands the prefill leg's params and
first token to a decode leg admitted earlier with await_kv_transfer_id; router only (server.py).

Encode (encode_rpc.py) runs the vision encoder on images and returns the EC params of its outputs.

GenerateStream (the router's path) runs many requests over one call with the same per-request
rules and the same table; see worker_stream.py.

Drain (the RPC, and SIGTERM through WorkerServer.drain): NOT_SERVING, new requests refused with
UNAVAILABLE, running ones may finish until the timeout, the rest end with UNAVAILABLE so a
router resumes them elsewhere (router/migration.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import grpc

from pdcluster import __version__
from pdcluster._proto import common_pb2, worker_pb2, worker_pb2_grpc
from pdcluster.engine.async_engine import AsyncEngine
from pdcluster.worker import convert, encode_rpc
from pdcluster.worker.inflight import Inflight, Refusal
from pdcluster.worker.request_table import RequestTable
from pdcluster.worker.roles import RoleHandler
from pdcluster.worker.worker_stats import HitRateWindow, KVEventsInfo, build_info, build_stats
from pdcluster.worker.worker_stream import StreamSession

if TYPE_CHECKING:
    from pdcluster.worker.health import EngineHealth
    from pdcluster.worker.kv_events import KVEventService  # zmq: only when publishing

log = logging.getLogger(__name__)
DEFAULT_DRAIN_TIMEOUT_S = 10.0
_DRAIN_POLL_S = 0.05


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, engine: AsyncEngine, role: RoleHandler, *, worker_id: str, epoch: int,
                 kv_events: KVEventService | None = None) -> None:
        """kv_events: None when the publisher is disabled."""
        self.engine = engine
        self.role = role
        self.worker_id = worker_id
        self.epoch = epoch
        self.kv_events = kv_events
        # The model directory: routers load the tokenizer from it (client-facing names are theirs).
        self.model_name = engine.model_path
        self.requests = RequestTable(engine, role)
        self._sessions: set[StreamSession] = set()
        self._hit_rate = HitRateWindow()
        self.health: EngineHealth | None = None  # set by start_worker_server (a drain reports NOT_SERVING)
        self.drain_timeout_s = DEFAULT_DRAIN_TIMEOUT_S

    @property
    def num_inflight(self) -> int:
        return len(self.requests)

    # -- Generate -------------------------------------------------------------------------------
    async def Generate(self, request: worker_pb2.WorkerGenerateRequest, context: grpc.aio.ServicerContext):
        requests = self.requests
        request_id = request.request_id or requests.new_request_id()
        try:
            params, kv = requests.check(request, request_id)
        except Refusal as refusal:
            await context.abort(refusal.code, refusal.message)
        inflight = Inflight(num_prompt_tokens=len(request.prompt_token_ids))
        requests.track(request_id, inflight)
        inflight.task = requests.start_pump(request_id, request, params, kv, inflight.queue.put_nowait)
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        collected: list[worker_pb2.WorkerGenerateResponse] = []
        try:
            while True:
                item = await self._next(inflight, deadline, context, sent=bool(collected) or inflight.num_tokens > 0)
                response = requests.response(request_id, inflight, item, params)
                if request.stream:
                    yield response
                else:
                    collected.append(response)
                if response.finished:
                    break
            if not request.stream:
                yield convert.merge_responses(collected)
        finally:
            # Runs on normal end, client cancellation (CancelledError) and abort alike.
            if inflight.task is not None and not inflight.task.done():
                inflight.task.cancel()
            requests.forget(request_id, inflight)

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
            self.requests.count_ended("deadline")
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded; request aborted")
        refusal = self.requests.refusal_for(item, sent)
        if refusal is not None:
            await context.abort(refusal.code, refusal.message)
        return item

    async def GenerateStream(self, request_iterator: Any, context: grpc.aio.ServicerContext):  # noqa: N802
        session = StreamSession(self.requests)
        self._sessions.add(session)
        try:
            await session.serve(request_iterator, context)
        finally:
            self._sessions.discard(session)

    # -- Abort, Stats, GetInfo --------------------------------------------------------------------
    async def Abort(self, request: common_pb2.AbortRequest, context: grpc.aio.ServicerContext) -> common_pb2.AbortResponse:
        aborted = []
        for request_id in request.request_ids:
            if self.requests.abort(request_id):
                aborted.append(request_id)
            else:
                # Not streaming here, but the engine may still hold its blocks (e.g. a producer's
                # under a transfer lease): abort there too; unknown ids are ignored.
                await self.engine.abort(request_id)
        return common_pb2.AbortResponse(aborted_request_ids=aborted)

    async def drain(self, timeout_s: float | None = None) -> tuple[int, int]:
        """(requests that finished while draining, requests moved at the timeout)."""
        timeout_s = self.drain_timeout_s if timeout_s is None else timeout_s
        self.requests.draining = True
        if self.health is not None:
            await self.health.drain()
        running = len(self.requests)
        log.info("draining: %d request(s) running, waiting up to %.1fs", running, timeout_s)
        end = time.monotonic() + max(0.0, timeout_s)
        while len(self.requests) and time.monotonic() < end:
            await asyncio.sleep(_DRAIN_POLL_S)
        moved = self.requests.move_all()
        if moved:
            log.warning("drain timeout: %d request(s) ended with UNAVAILABLE to continue on another worker", moved)
        return max(0, running - moved), moved

    async def Drain(self, request: worker_pb2.DrainRequest, context: grpc.aio.ServicerContext) -> worker_pb2.DrainResponse:  # noqa: N802
        timeout_s = request.timeout_s if request.HasField("timeout_s") else None
        finished, moved = await self.drain(timeout_s)
        return worker_pb2.DrainResponse(num_finished=finished, num_moved=moved)

    def abort_all(self) -> int:
        """Shutdown: abort every request and end every GenerateStream once its replies are out."""
        num = self.requests.abort_all()
        for session in self._sessions:
            session.close()
        return num

    def kv_events_info(self) -> KVEventsInfo:
        return self.kv_events.info() if self.kv_events is not None else KVEventsInfo()

    async def Stats(self, request: worker_pb2.StatsRequest, context: grpc.aio.ServicerContext) -> common_pb2.WorkerStats:
        stats = self.engine.get_stats()
        hit_rate = self._hit_rate.update(int(stats.get("prefix_cache_queries", 0)), int(stats.get("prefix_cache_hits", 0)))
        return build_stats(self.worker_id, self.role.proto_role, self.model_name,
                           self.engine.block_size, stats, self.kv_events_info(), hit_rate)

    async def ProvideKVParams(self, request: worker_pb2.ProvideKVParamsRequest,  # noqa: N802
                              context: grpc.aio.ServicerContext) -> worker_pb2.ProvideKVParamsResponse:
        try:
            self.requests.provide(request)
        except Refusal as refusal:
            await context.abort(refusal.code, refusal.message)
        return worker_pb2.ProvideKVParamsResponse()

    async def Encode(self, request: worker_pb2.EncodeRequest,  # noqa: N802
                     context: grpc.aio.ServicerContext) -> worker_pb2.EncodeResponse:
        try:
            return await encode_rpc.encode(self.engine, request, request_id=request.request_id or
                                           self.requests.new_request_id(), timeout_s=context.time_remaining(),
                                           draining=self.requests.draining)
        except encode_rpc.EncodeRefused as refused:
            await context.abort(refused.code, refused.message)

    async def GetInfo(self, request: worker_pb2.GetInfoRequest, context: grpc.aio.ServicerContext) -> worker_pb2.WorkerInfo:
        return build_info(self.worker_id, self.role.proto_role, self.engine, self.epoch,
                          self.kv_events_info(), self.role.connector_name, __version__)
