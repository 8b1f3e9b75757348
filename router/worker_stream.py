"""WorkerStream: the router's requests to one worker over one long-lived Worker.GenerateStream.

A Generate call per request costs an HTTP/2 stream set-up, metadata, a status and a message read
per delta; here a request is an entry in a message and one message brings the deltas of every
request that had one ready (about one engine step). The worker side is
pdcluster/worker/worker_stream.py.

    start(request, timeout) -> StreamCall   queued for the writer task (which batches whatever is
                                            queued while a write is in flight), tagged
    reader task                             message -> deltas and errors by tag -> their StreamCall
    the stream breaks                       every open StreamCall fails with the stream's error
                                            (UNAVAILABLE: the legs retry elsewhere if nothing was
                                            sent yet); the next start opens a new stream

A StreamCall looks like the slice of grpc.aio.UnaryStreamCall the legs use -- read() returning
deltas then grpc.aio.EOF, raising AioRpcError for a failure and CancelledError after cancel();
cancel(); done() -- so legs and orchestrator treat both channels alike.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque

import grpc

from pdcluster._proto import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

_CODES = {code.value[0]: code for code in grpc.StatusCode}
# Stream-level failures that name a worker fault keep their code; anything else is UNAVAILABLE.
_KEEP_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class StreamCall:
    """One request on a WorkerStream."""

    __slots__ = ("_stream", "tag", "_items", "_waiter", "_error", "_done", "_timer")

    def __init__(self, stream: WorkerStream, tag: int) -> None:
        self._stream = stream
        self.tag = tag
        self._items: deque[worker_pb2.WorkerGenerateResponse] = deque()
        self._waiter: asyncio.Future | None = None
        self._error: BaseException | None = None
        self._done = False
        self._timer: asyncio.TimerHandle | None = None

    async def read(self) -> worker_pb2.WorkerGenerateResponse | object:
        while not self._items:
            if self._error is not None:
                raise self._error
            if self._done:
                return grpc.aio.EOF
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        return self._items.popleft()

    def done(self) -> bool:
        return self._done

    def cancel(self) -> bool:
        """Stop the request on the worker (its blocks are freed there) and end reads with
        CancelledError, as grpc.aio's cancel() does."""
        if self._done:
            return False
        self._stream._abort(self)
        self._end(asyncio.CancelledError())
        return True

    # -- fed by the stream ---------------------------------------------------------------------
    def _push(self, resp: worker_pb2.WorkerGenerateResponse) -> None:
        if self._done:
            return
        self._items.append(resp)
        if resp.finished:
            self._end(None)
        elif self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, error: BaseException) -> None:
        if not self._done:
            self._end(error)

    def _expire(self) -> None:
        if not self._done:
            self._stream._abort(self)  # the worker's own timer (timeout_s) ends it too
            self._end(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"))

    def _end(self, error: BaseException | None) -> None:
        self._done = True
        if error is not None:
            self._items.clear()  # a failed or cancelled call yields nothing more
            self._error = error
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            if isinstance(error, asyncio.CancelledError):
                waiter.cancel()
            else:
                waiter.set_result(None)


class WorkerStream:
    def __init__(self, stub: worker_pb2_grpc.WorkerStub, address: str, max_message_bytes: int) -> None:
        self._stub = stub
        self.address = address
        # A request too large for one message fails alone; batches stay well under the limit.
        self._max_request_bytes = max_message_bytes - 1024
        self._max_batch_bytes = max(1, max_message_bytes // 2)
        self._tags = itertools.count(1)
        self._calls: dict[int, StreamCall] = {}
        self._call: grpc.aio.StreamStreamCall | None = None
        self._tasks: tuple[asyncio.Task, ...] = ()
        self._gens: list[worker_pb2.StreamGenerate] = []
        self._gen_bytes = 0
        self._aborts: list[int] = []
        self._wake = asyncio.Event()

    @property
    def num_open(self) -> int:
        return len(self._calls)

    def start(self, request: worker_pb2.WorkerGenerateRequest, timeout_s: float | None) -> StreamCall:
        call = StreamCall(self, next(self._tags))
        size = request.ByteSize()
        if size > self._max_request_bytes:
            call._fail(rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"request of {size} bytes is over the worker channel's limit of "
                                 f"{self._max_request_bytes}"))
            return call
        if self._call is None:
            self._open()
        gen = worker_pb2.StreamGenerate(request=request, tag=call.tag)
        if timeout_s is not None:
            gen.timeout_s = timeout_s
            call._timer = asyncio.get_running_loop().call_later(max(0.0, timeout_s), call._expire)
        self._calls[call.tag] = call
        self._gens.append(gen)
        self._gen_bytes += size
        self._wake.set()
        return call

    def _abort(self, call: StreamCall) -> None:
        if self._calls.pop(call.tag, None) is not None and self._call is not None:
            self._aborts.append(call.tag)
            self._wake.set()

    # -- the stream ----------------------------------------------------------------------------
    def _open(self) -> None:
        rpc = self._stub.GenerateStream()
        self._call = rpc
        loop = asyncio.get_running_loop()
        self._tasks = (loop.create_task(self._write_loop(rpc)), loop.create_task(self._read_loop(rpc)))

    async def _write_loop(self, rpc: grpc.aio.StreamStreamCall) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._gens or self._aborts:
                    await rpc.write(self._next_message())
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as e:
            log.debug("worker stream to %s: write failed: %r", self.address, e)  # the reader reports it

    def _next_message(self) -> worker_pb2.WorkerStreamRequest:
        msg = worker_pb2.WorkerStreamRequest(abort_tags=self._aborts)
        self._aborts = []
        if self._gen_bytes <= self._max_batch_bytes:
            msg.generate.extend(self._gens)
            self._gens, self._gen_bytes = [], 0
            return msg
        size = n = 0
        while n < len(self._gens) and (n == 0 or size + self._gens[n].ByteSize() <= self._max_batch_bytes):
            size += self._gens[n].ByteSize()
            n += 1
        msg.generate.extend(self._gens[:n])
        self._gens = self._gens[n:]
        self._gen_bytes = sum(g.ByteSize() for g in self._gens)
        return msg

    async def _read_loop(self, rpc: grpc.aio.StreamStreamCall) -> None:
        calls = self._calls
        error: BaseException = rpc_error(grpc.StatusCode.INTERNAL, "the router's stream reader failed")
        try:
            while (msg := await rpc.read()) is not grpc.aio.EOF:
                for delta in msg.deltas:
                    call = calls.get(delta.stream_tag)
                    if call is not None:
                        if delta.finished:
                            del calls[delta.stream_tag]
                        call._push(delta)
                for err in msg.errors:
                    call = calls.pop(err.tag, None)
                    if call is not None:
                        call._fail(rpc_error(_CODES.get(err.code, grpc.StatusCode.UNKNOWN), err.message))
            error = rpc_error(grpc.StatusCode.UNAVAILABLE, "the worker closed its request stream")
        except grpc.aio.AioRpcError as e:
            code = e.code() if e.code() in _KEEP_CODES else grpc.StatusCode.UNAVAILABLE
            error = rpc_error(code, f"request stream lost: {e.code().name}: {e.details()}")
        except asyncio.CancelledError:
            error = rpc_error(grpc.StatusCode.UNAVAILABLE, "the router closed the worker stream")
            raise
        except Exception:
            log.exception("worker stream to %s: reader failed", self.address)
        finally:
            self._lost(rpc, error)

    def _lost(self, rpc: grpc.aio.StreamStreamCall, error: BaseException) -> None:
        """The stream is gone: fail what was on it; the next start opens a new one."""
        if self._call is not rpc:
            return
        self._call = None
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        self._tasks = ()
        rpc.cancel()
        calls, self._calls = self._calls, {}
        self._gens, self._gen_bytes, self._aborts = [], 0, []
        for call in calls.values():
            call._fail(error)
        if calls:
            log.info("worker stream to %s lost with %d requests on it: %s", self.address, len(calls), error)

    async def close(self) -> None:
        tasks = self._tasks
        if self._call is not None:
            self._lost(self._call, rpc_error(grpc.StatusCode.UNAVAILABLE, "the router closed its channel to this worker"))
        await asyncio.gather(*tasks, return_exceptions=True)
