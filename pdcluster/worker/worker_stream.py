"""StreamSession: one Worker.GenerateStream call -- many requests over one gRPC stream.

Why: a Generate call per request costs the router (and this worker) an HTTP/2 stream set-up, its
metadata and status, and one message read per delta: about half of the router's CPU per request.
Over one long-lived stream a request is one entry in a message, and one message carries the
deltas of every request that had one ready -- usually all of one engine step (vLLM's engine core
batches its outputs per step the same way).

    reader task   generate -> check (as Generate) -> a pump task per request
                  abort_tags -> end those requests with finish_reason ABORT
    pump task     engine deltas -> the outbox (stream=false: merged, sent once at the end)
    writer        (the RPC handler) outbox -> one WorkerStreamResponse per wake-up, split to
                  stay under max_batch_bytes

Each generate carries a tag, unique on the stream, that its deltas and errors echo: the router
matches replies by tag, so a request id reused right after an abort never receives the old
request's late deltas. Per request everything is Generate's: the same checks and status codes
(sent as StreamError), deadlines (timeout_s), Abort RPC, and every way a request ends frees its
blocks. The call ending (router gone, connection lost) aborts every request still on it.

An abort can also name a tag whose request already finished here: the router cancelled the call
before its last reply reached it (a prefill worker that stalled, then resumed, finishes the leg
between reading its start and its abort). If that reply handed out KV (a producer's blocks under
a transfer lease), nobody will ever read them: the engine lets them go now, not at lease expiry.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import grpc

from pdcluster._proto import worker_pb2
from pdcluster.sampling_params import SamplingParams
from pdcluster.worker import convert
from pdcluster.worker.inflight import Inflight, Refusal
from pdcluster.worker.request_table import RequestTable, abort_response

log = logging.getLogger(__name__)

# A batch is flushed before it passes this: well under the router's 4 MiB receive limit.
DEFAULT_MAX_BATCH_BYTES = 1 << 20
# Finished runs that handed out KV, remembered per stream for a late abort; older ones are left to
# their lease's expiry (a late abort comes within one round trip of the reply).
MAX_HANDED_RUNS = 1024


@dataclass(eq=False)
class _Run:
    tag: int
    request_id: str
    params: SamplingParams
    stream: bool
    inflight: Inflight
    collected: list[worker_pb2.WorkerGenerateResponse] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None
    ended: bool = False


class StreamSession:
    def __init__(self, requests: RequestTable, max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES) -> None:
        self.requests = requests  # the worker's table, shared with Generate
        self.max_batch_bytes = max_batch_bytes
        self._runs: dict[int, _Run] = {}
        self._handed: OrderedDict[int, str] = OrderedDict()  # tag -> request id: ended, KV held for a reader
        self._out: list[worker_pb2.WorkerGenerateResponse | worker_pb2.StreamError] = []
        self._wake = asyncio.Event()
        self._peer_done = False
        self._closing = False

    def close(self) -> None:
        """Worker shutdown: refuse new requests, end the call once the running ones have ended
        (they are aborted first) and their last replies are written."""
        self._closing = True
        self._wake.set()

    async def serve(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        loop = asyncio.get_running_loop()
        reader = loop.create_task(self._read(request_iterator))
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                if reader.done() and reader.exception() is not None:
                    error = reader.exception()
                    if isinstance(error, Refusal):
                        await context.abort(error.code, error.message)
                    raise error
                if self._out:
                    out, self._out = self._out, []
                    for batch in self._batches(out):
                        await context.write(batch)
                if (self._peer_done or self._closing) and not self._runs and not self._out:
                    return  # the router closed its side (or this worker stops); every request has ended
        finally:
            reader.cancel()
            if self._runs and not self._closing:  # a router gone (killed, cut off, past its deadline)
                self.requests.count_ended("stream_lost", len(self._runs))
                log.warning("request stream from %s ended with %d request(s) running: aborting them",
                            context.peer(), len(self._runs))
            for run in list(self._runs.values()):  # the call ended under them: abort each
                self._finish(run)
                if run.inflight.task is not None:
                    run.inflight.task.cancel()

    # -- the router's messages -----------------------------------------------------------------
    async def _read(self, request_iterator: Any) -> None:
        try:
            async for msg in request_iterator:
                # Aborts first: the sender cancelled those before it started these.
                for tag in msg.abort_tags:
                    run = self._runs.get(tag)
                    if run is not None:
                        self.requests.abort(run.request_id)  # cancels the pump, ends the run with ABORT
                    else:
                        await self._release_handed(tag)
                for generate in msg.generate:
                    self._start(generate)
        finally:
            self._peer_done = True
            self._wake.set()

    async def _release_handed(self, tag: int) -> None:
        """A late abort of a run that ended handing out KV: its reply never reached the router, so
        no decode leg will read the blocks; free them (unless the id runs here again by now)."""
        request_id = self._handed.pop(tag, None)
        if request_id is not None and not self.requests.is_running(request_id):
            log.info("request %s: aborted after it ended here; its held KV is released", request_id)
            await self.requests.engine.abort(request_id)

    def _start(self, generate: worker_pb2.StreamGenerate) -> None:
        request = generate.request
        tag = generate.tag
        if tag in self._runs:
            # Replies could not be told apart: a broken sender; end its stream (and its requests).
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"tag: {tag} is already in use on this stream")
        request_id = request.request_id
        if self._closing:
            self._error(tag, request_id, grpc.StatusCode.UNAVAILABLE, "the worker is shutting down")
            return
        if not request_id:
            self._error(tag, request_id, grpc.StatusCode.INVALID_ARGUMENT, "request_id: required on GenerateStream")
            return
        requests = self.requests
        try:
            params, kv = requests.check(request, request_id)
        except Refusal as refusal:
            self._error(tag, request_id, refusal.code, refusal.message)
            return
        inflight = Inflight(num_prompt_tokens=len(request.prompt_token_ids))
        run = _Run(tag, request_id, params, request.stream, inflight)
        inflight.on_abort = lambda: self._end_aborted(run)
        inflight.deliver = lambda item: self._deliver(run, item)
        self._runs[tag] = run
        requests.track(request_id, inflight)
        loop = asyncio.get_running_loop()
        inflight.task = requests.start_pump(request_id, request, params, kv, lambda item: self._deliver(run, item))
        if generate.HasField("timeout_s"):
            run.timer = loop.call_later(max(0.0, generate.timeout_s), self._expire, run)

    # -- one request ---------------------------------------------------------------------------
    def _deliver(self, run: _Run, item: Any) -> bool:
        """Queue one engine output (or exception) of a run; True when the run has ended."""
        if run.ended:
            return True
        inflight = run.inflight
        refusal = self.requests.refusal_for(item, sent=bool(run.collected) or inflight.num_tokens > 0)
        if refusal is not None:
            self._finish(run)
            self._error(run.tag, run.request_id, refusal.code, refusal.message)
            return True
        response = self.requests.response(run.request_id, inflight, item, run.params)
        self._emit(run, response)
        return response.finished

    def _emit(self, run: _Run, response: worker_pb2.WorkerGenerateResponse) -> None:
        if response.finished:
            self._finish(run)
            if response.HasField("kv_transfer_params"):
                self._handed[run.tag] = run.request_id
                if len(self._handed) > MAX_HANDED_RUNS:
                    self._handed.popitem(last=False)
        if not run.stream:
            run.collected.append(response)
            if not response.finished:
                return
            response = convert.merge_responses(run.collected)
        response.stream_tag = run.tag
        self._out.append(response)
        self._wake.set()

    def _end_aborted(self, run: _Run) -> None:
        if not run.ended:
            self._emit(run, abort_response(run.request_id, run.inflight))

    def _expire(self, run: _Run) -> None:
        if run.ended:
            return
        self._finish(run)
        self.requests.count_ended("deadline")
        if run.inflight.task is not None:
            run.inflight.task.cancel()  # closes AsyncEngine.generate: the engine frees the blocks now
        self._error(run.tag, run.request_id, grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded; request aborted")

    def _finish(self, run: _Run) -> None:
        """The run sends nothing more: forget it (its pump ends on its own or is cancelled)."""
        run.ended = True
        if run.timer is not None:
            run.timer.cancel()
        if self._runs.get(run.tag) is run:
            del self._runs[run.tag]
        self.requests.forget(run.request_id, run.inflight)

    def _error(self, tag: int, request_id: str, code: grpc.StatusCode, message: str) -> None:
        self._out.append(worker_pb2.StreamError(tag=tag, request_id=request_id, code=code.value[0], message=message))
        self._wake.set()

    # -- the replies ---------------------------------------------------------------------------
    def _batches(self, out: list) -> list[worker_pb2.WorkerStreamResponse]:
        """The outbox as messages of at most ~max_batch_bytes; order kept per request (a request's
        error is always its last item, and errors follow deltas within a message)."""
        batches = []
        deltas: list = []
        errors: list = []
        size = 0
        for item in out:
            n = item.ByteSize() + 8
            if size and size + n > self.max_batch_bytes:
                batches.append(worker_pb2.WorkerStreamResponse(deltas=deltas, errors=errors))
                deltas, errors, size = [], [], 0
            (errors if isinstance(item, worker_pb2.StreamError) else deltas).append(item)
            size += n
        if deltas or errors:
            batches.append(worker_pb2.WorkerStreamResponse(deltas=deltas, errors=errors))
        return batches
