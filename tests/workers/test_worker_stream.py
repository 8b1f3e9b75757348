"""Worker.GenerateStream over a real AsyncEngine (the demo model) and a real gRPC server: many
requests on one stream give Generate's tokens, their deltas share messages, and every way a
request ends (finish, error, abort by tag or by the Abort RPC, deadline, the stream closing,
worker shutdown) is per request and frees its KV blocks."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest
from workers.test_servicer import (
    LONG,
    NUM_REF,
    PROMPT,
    _ended_in_engine,
    _engine_args,
    _engine_request,
    _until,
    req,
)
from workers.test_servicer import serve as serve_on

from pdcluster import LLM
from pdcluster._proto import common_pb2, worker_pb2
from pdcluster.engine.async_engine import AsyncEngine
from pdcluster.engine.request import RequestStatus
from pdcluster.sampling_params import SamplingParams
from pdcluster.worker.worker_stream import StreamSession


@pytest.fixture(scope="module")
def ref_tokens(demo_model: str) -> list[int]:
    llm = LLM(model=demo_model, max_model_len=_engine_args(demo_model).max_model_len)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=NUM_REF, temperature=0.0, ignore_eos=True))[0]
    return list(out.outputs[0].token_ids)


def gen(tag: int, rid: str, timeout_s: float | None = None, **kw: Any) -> worker_pb2.StreamGenerate:
    g = worker_pb2.StreamGenerate(request=req(rid, **kw), tag=tag)
    if timeout_s is not None:
        g.timeout_s = timeout_s
    return g


class Replies:
    """Everything read from a stream, by tag."""

    def __init__(self) -> None:
        self.deltas: dict[int, list] = {}
        self.errors: dict[int, worker_pb2.StreamError] = {}
        self.requests_per_message: list[int] = []

    def ended(self, tag: int) -> bool:
        d = self.deltas.get(tag)
        return tag in self.errors or bool(d and d[-1].finished)

    def tokens(self, tag: int) -> list[int]:
        return [t for d in self.deltas[tag] for t in d.token_ids]

    async def read_until(self, call, cond) -> None:
        while not cond():
            msg = await call.read()
            assert msg is not grpc.aio.EOF, "the stream ended early"
            self.requests_per_message.append(len({d.stream_tag for d in msg.deltas}))
            for d in msg.deltas:
                assert not self.ended(d.stream_tag), f"tag {d.stream_tag}: a delta after its end"
                self.deltas.setdefault(d.stream_tag, []).append(d)
            for e in msg.errors:
                assert not self.ended(e.tag)
                self.errors[e.tag] = e


async def open_stream(stub, *generates: worker_pb2.StreamGenerate) -> tuple[Any, Replies]:
    """A new GenerateStream with these requests sent in its first message."""
    call = stub.GenerateStream()
    await call.write(worker_pb2.WorkerStreamRequest(generate=generates))
    return call, Replies()


async def started(call, r: Replies, *tags: int) -> None:
    """Wait for the first delta of each of these requests."""
    await r.read_until(call, lambda: all(r.deltas.get(t) for t in tags))


def serve(engine: AsyncEngine, test, hold: tuple[str, ...] = ()) -> None:
    serve_on(engine, test, hold=hold)
    # Every test leaves the engine idle: aborts reach the engine thread a moment after the reply.
    deadline = time.monotonic() + 10
    while engine.get_stats()["kv_blocks_used"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.get_stats()["kv_blocks_used"] == 0


def test_many_requests_one_stream(engine: AsyncEngine, ref_tokens: list[int]) -> None:
    async def t(stub, server, ch):
        tags = [1, 2, 3, 4]
        call, r = await open_stream(stub, gen(1, "m1"), gen(2, "m2"), gen(3, "m3"), gen(4, "m4", stream=False))
        await r.read_until(call, lambda: all(r.ended(t) for t in tags))
        for tag in tags:
            assert r.tokens(tag) == ref_tokens
            last = r.deltas[tag][-1]
            assert last.request_id == f"m{tag}" and last.usage.completion_tokens == NUM_REF
        assert len(r.deltas[4]) == 1  # stream=false: one merged reply
        assert max(r.requests_per_message) >= 2  # requests stepped together share messages
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK
        assert server.servicer.num_inflight == 0
    serve(engine, t)


def test_errors_are_per_request(engine: AsyncEngine, ref_tokens: list[int]) -> None:
    async def t(stub, server, ch):
        bad = gen(2, "e2")
        bad.request.sampling_params.temperature = -1.0
        call, r = await open_stream(stub, gen(1, "e1", max_tokens=LONG), bad, gen(3, ""), gen(5, "e1"), gen(6, "e6"))
        await r.read_until(call, lambda: all(r.ended(t) for t in (2, 3, 5, 6)))
        assert r.errors[2].code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "temperature" in r.errors[2].message
        assert r.errors[3].code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "request_id" in r.errors[3].message
        assert r.errors[5].code == grpc.StatusCode.ALREADY_EXISTS.value[0]  # e1 runs under tag 1
        assert r.tokens(6) == ref_tokens  # the good request next to the bad ones is untouched
        assert not r.ended(1)
        await call.write(worker_pb2.WorkerStreamRequest(abort_tags=[1, 12345]))  # unknown tags are ignored
        await r.read_until(call, lambda: r.ended(1))
        assert r.deltas[1][-1].finish_reason == common_pb2.FINISH_REASON_ABORT
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK
    serve(engine, t, hold=("e1",))


def test_a_reused_tag_ends_the_stream(engine: AsyncEngine) -> None:
    async def t(stub, server, ch):
        call, r = await open_stream(stub, gen(1, "t1", max_tokens=LONG))
        await started(call, r, 1)
        one = await _engine_request(engine, "t1")
        await call.write(worker_pb2.WorkerStreamRequest(generate=[gen(1, "t2")]))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await r.read_until(call, lambda: False)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tag" in e.value.details()
        await _ended_in_engine(engine, one)
        assert await _until(lambda: server.servicer.num_inflight == 0)
    serve(engine, t, hold=("t1",))


def test_abort_by_tag_reuse_of_id_and_deadline(engine: AsyncEngine, ref_tokens: list[int]) -> None:
    async def t(stub, server, ch):
        # "a" and "b" are held after their first delta (the new "a" is not); b's deadline ends it
        # after 0.5 s whether or not it has sent a delta.
        call, r = await open_stream(stub, gen(1, "a", max_tokens=LONG), gen(2, "b", max_tokens=LONG, timeout_s=0.5))
        await started(call, r, 1)
        ra = await _engine_request(engine, "a")
        # Abort "a" and start a new "a" in the same message: the new one gets only its own replies.
        await call.write(worker_pb2.WorkerStreamRequest(abort_tags=[1], generate=[gen(3, "a")]))
        await r.read_until(call, lambda: r.ended(1) and r.ended(3) and r.ended(2))
        assert r.deltas[1][-1].finish_reason == common_pb2.FINISH_REASON_ABORT
        assert r.deltas[1][-1].usage.completion_tokens == len(r.tokens(1)) < LONG
        assert r.tokens(3) == ref_tokens
        assert r.errors[2].code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0], r.errors.get(2)
        assert len(r.tokens(2)) < LONG if 2 in r.deltas else True
        assert server.servicer.requests.ended == {"deadline": 1, "stream_lost": 0}  # /metrics requests_ended
        assert await _until(lambda: ra.status == RequestStatus.FINISHED_ABORTED)
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK
        assert await _until(lambda: server.servicer.num_inflight == 0)
    serve(engine, t, hold=("a", "b"))


def test_abort_rpc_reaches_stream_requests(engine: AsyncEngine) -> None:
    async def t(stub, server, ch):
        call, r = await open_stream(stub, gen(7, "x", max_tokens=LONG))
        await started(call, r, 7)
        resp = await stub.Abort(common_pb2.AbortRequest(request_ids=["x"]))
        assert list(resp.aborted_request_ids) == ["x"]
        await r.read_until(call, lambda: r.ended(7))
        assert r.deltas[7][-1].finish_reason == common_pb2.FINISH_REASON_ABORT
        call.cancel()
    serve(engine, t, hold=("x",))


def test_closing_the_stream_aborts_its_requests(engine: AsyncEngine) -> None:
    async def t(stub, server, ch):
        call, r = await open_stream(stub, gen(1, "c1", max_tokens=LONG), gen(2, "c2", max_tokens=LONG))
        await started(call, r, 1, 2)
        reqs = [await _engine_request(engine, rid) for rid in ("c1", "c2")]
        call.cancel()  # the router went away
        for one in reqs:
            await _ended_in_engine(engine, one)
        assert await _until(lambda: server.servicer.num_inflight == 0)
        assert server.servicer.requests.ended == {"deadline": 0, "stream_lost": 2}  # /metrics requests_ended
    serve(engine, t, hold=("c1", "c2"))


def test_shutdown_ends_the_stream(engine: AsyncEngine) -> None:
    async def t(stub, server, ch):
        call, r = await open_stream(stub, gen(1, "s1", max_tokens=LONG))
        await started(call, r, 1)
        one = await _engine_request(engine, "s1")
        await server.stop(grace=10.0)  # must not wait out the grace: the stream ends itself
        await r.read_until(call, lambda: r.ended(1))
        assert r.deltas[1][-1].finish_reason == common_pb2.FINISH_REASON_ABORT
        assert await call.read() is grpc.aio.EOF and await call.code() == grpc.StatusCode.OK
        await _ended_in_engine(engine, one)
    serve(engine, t, hold=("s1",))


def test_batches_stay_under_the_byte_bound() -> None:
    session = StreamSession(requests=None, max_batch_bytes=200)  # type: ignore[arg-type]
    out = [worker_pb2.WorkerGenerateResponse(request_id=f"r{i}", token_ids=list(range(20)), stream_tag=i)
           for i in range(10)]
    out.insert(3, worker_pb2.StreamError(tag=99, request_id="bad", code=3, message="x"))
    batches = session._batches(out)
    assert len(batches) > 1
    assert all(b.ByteSize() <= 200 + 16 for b in batches)
    assert [d.stream_tag for b in batches for d in b.deltas] == list(range(10))
    assert [e.tag for b in batches for e in b.errors] == [99]
    one_big = [worker_pb2.WorkerGenerateResponse(request_id="big", token_ids=list(range(500)))]
    assert len(session._batches(one_big)) == 1  # a single reply over the bound still goes, alone


def test_router_reaches_an_mtls_worker_over_the_stream(engine: AsyncEngine, ref_tokens: list[int], certs,
                                                       demo_model: str) -> None:
    """The router's worker channel (GenerateStream) with mutual TLS: the worker requires the
    router's client certificate; tokens through the router equal the offline engine's."""
    from pdcluster._proto import router_pb2, router_pb2_grpc
    from pdcluster.router.app import Router
    from pdcluster.router.config import RouterConfig
    from pdcluster.worker.server import start_worker_server
    from pdcluster.worker.tls import TLSConfig

    async def main():
        server_tls = TLSConfig(cert=str(certs / "server.pem"), key=str(certs / "server.key"), ca=str(certs / "ca.pem"))
        server, port = await start_worker_server(engine, "both", tls=server_tls)
        router = Router(RouterConfig(
            workers=(f"localhost:{port}",), model=demo_model, grpc_port=0, http_port=None, policy="round_robin",
            worker_tls=TLSConfig(ca=str(certs / "ca.pem"), cert=str(certs / "client.pem"),
                                 key=str(certs / "client.key"))))
        try:
            await router.start()
            for _ in range(3000):  # the first health check (over mTLS) admits the worker (30 s: slow machines)
                if router.registry.num_healthy:
                    break
                await asyncio.sleep(0.01)
            async with grpc.aio.insecure_channel(router.grpc_address) as ch:
                stub = router_pb2_grpc.RouterStub(ch)
                req_ = router_pb2.GenerateRequest(prompt_token_ids=router_pb2.TokenIds(ids=PROMPT), stream=True,
                                                  sampling_params=common_pb2.SamplingParams(
                                                      max_tokens=NUM_REF, temperature=0, ignore_eos=True))
                for _ in range(2):  # the second request reuses the open stream
                    got = [t async for r in stub.Generate(req_, timeout=30) for t in r.token_ids]
                    assert got == ref_tokens
            assert len(server.servicer._sessions) == 1  # both went over one GenerateStream
        finally:
            await router.stop()
            await server.stop(None)
    asyncio.run(main())
