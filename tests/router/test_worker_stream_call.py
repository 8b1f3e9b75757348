"""StreamCall, the router's handle on one request of a multiplexed worker stream, behaves like
the grpc.aio call the legs were written against: deltas in order then EOF, AioRpcError for a
failure, CancelledError after cancel() (also for a read already waiting), a deadline of its own,
and an abort queued for the worker whenever it stops early. Pure asyncio, no sockets; the stream
end to end is in tests/workers/test_worker_stream.py and the router tests."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdcluster._proto import worker_pb2
from pdcluster.router.worker_stream import StreamCall, WorkerStream


def delta(tag: int, *tokens: int, finished: bool = False) -> worker_pb2.WorkerGenerateResponse:
    return worker_pb2.WorkerGenerateResponse(stream_tag=tag, token_ids=tokens, finished=finished)


def new_call(stream: WorkerStream, tag: int = 1) -> StreamCall:
    """A call registered on a stream that is open as far as aborts go (no RPC is made)."""
    call = StreamCall(stream, tag)
    stream._calls[tag] = call
    stream._call = object()  # type: ignore[assignment]  # _abort queues tags only while open
    return call


def run(coro):
    return asyncio.run(coro)


def test_reads_in_order_then_eof() -> None:
    async def t():
        s = WorkerStream(None, "w", 1 << 20)  # type: ignore[arg-type]
        call = new_call(s)
        reader = asyncio.ensure_future(call.read())
        await asyncio.sleep(0)
        call._push(delta(1, 5))
        assert list((await reader).token_ids) == [5]
        call._push(delta(1, 6))
        call._push(delta(1, 7, finished=True))
        assert call.done()
        assert [list((await call.read()).token_ids) for _ in range(2)] == [[6], [7]]
        assert await call.read() is grpc.aio.EOF
        assert not call.cancel() and s._aborts == []  # a finished call has nothing to stop
    run(t())


def test_cancel_wakes_a_waiting_read_and_queues_an_abort() -> None:
    async def t():
        s = WorkerStream(None, "w", 1 << 20)  # type: ignore[arg-type]
        call = new_call(s, 4)
        reader = asyncio.ensure_future(call.read())
        await asyncio.sleep(0)
        call._push(delta(4, 1))  # a delta that arrived but was not read is dropped on cancel
        await reader
        call._push(delta(4, 2))
        assert call.cancel() and call.done()
        assert s._aborts == [4] and 4 not in s._calls
        with pytest.raises(asyncio.CancelledError):
            await call.read()
        call2 = new_call(s, 5)
        waiting = asyncio.ensure_future(call2.read())
        await asyncio.sleep(0)
        call2.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert asyncio.current_task().cancelling() == 0  # the read was cancelled, not this task
    run(t())


def test_failure_and_deadline() -> None:
    async def t():
        s = WorkerStream(None, "w", 1 << 20)  # type: ignore[arg-type]
        call = new_call(s, 2)
        call._push(delta(2, 9))
        call._fail(grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "gone"))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call.read()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and e.value.details() == "gone"
        late = new_call(s, 3)
        late._timer = asyncio.get_running_loop().call_later(0.05, late._expire)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await late.read()
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert s._aborts == [3]  # the worker is told too (it also has the timeout itself)
        late._push(delta(3, 1, finished=True))  # a late reply changes nothing
        with pytest.raises(grpc.aio.AioRpcError):
            await late.read()
    run(t())


def test_requests_batch_under_the_message_limit() -> None:
    s = WorkerStream(None, "w", 4096)  # type: ignore[arg-type]
    for tag in range(1, 11):
        req = worker_pb2.WorkerGenerateRequest(request_id=f"r{tag}", prompt_token_ids=list(range(200)))
        s._gens.append(worker_pb2.StreamGenerate(request=req, tag=tag))
        s._gen_bytes += req.ByteSize()
    s._aborts = [77]
    msgs = []
    while s._gens or s._aborts:
        msgs.append(s._next_message())
    assert len(msgs) > 1 and all(m.ByteSize() <= 4096 for m in msgs)
    assert [g.tag for m in msgs for g in m.generate] == list(range(1, 11))
    assert list(msgs[0].abort_tags) == [77]


def test_an_oversize_request_fails_alone() -> None:
    async def t():
        s = WorkerStream(None, "w", 2048)  # type: ignore[arg-type]
        call = s.start(worker_pb2.WorkerGenerateRequest(request_id="big", prompt_token_ids=list(range(5000))), None)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call.read()
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "bytes" in e.value.details()
        assert s._call is None and not s._calls  # no stream was opened for it
    run(t())
