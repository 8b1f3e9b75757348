"""The Worker servicer in-process over a real AsyncEngine (the demo model, random weights):
tokens match the offline LLM, cancellation / deadlines / Abort / shutdown end the request in the
engine and free its KV blocks, a dead engine is UNAVAILABLE and NOT_SERVING, duplicate ids,
roles, and TLS / mutual TLS."""

from __future__ import annotations

import asyncio
import pathlib
from typing import Any

import grpc
import pytest
from engine_hold import EngineHold
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdcluster import LLM
from pdcluster._proto import common_pb2, worker_pb2, worker_pb2_grpc
from pdcluster.config import EngineArgs
from pdcluster.decode_worker import DecodeRole
from pdcluster.engine.async_engine import AsyncEngine
from pdcluster.engine.outputs import CompletionOutput
from pdcluster.engine.request import RequestStatus
from pdcluster.prefill_worker import PrefillRole
from pdcluster.sampling_params import SamplingParams
from pdcluster.worker.server import start_worker_server
from pdcluster.worker.tls import TLSConfig, channel_credentials

MAX_MODEL_LEN = 256  # the `engine` fixture's (conftest.py)
PROMPT = [5, 6]
NUM_REF = 8  # tokens compared with the offline LLM
LONG = MAX_MODEL_LEN - len(PROMPT) - 4  # with serve(hold=...): a request that only ends when ended early


def _engine_args(model: str) -> EngineArgs:
    return EngineArgs(model=model, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def reference(demo_model: str) -> CompletionOutput:
    """The offline LLM's greedy completion of PROMPT."""
    llm = LLM(model=demo_model, max_model_len=MAX_MODEL_LEN)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=NUM_REF, temperature=0.0, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == NUM_REF
    return out


def req(rid: str, max_tokens: int = NUM_REF, stream: bool = True, **kw) -> worker_pb2.WorkerGenerateRequest:
    params = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return worker_pb2.WorkerGenerateRequest(request_id=rid, prompt_token_ids=PROMPT, stream=stream,
                                            sampling_params=params, **kw)


async def read_rest(call) -> list:
    out = []
    while (r := await call.read()) is not grpc.aio.EOF:
        out.append(r)
    return out


async def _until(cond, timeout: float = 10.0) -> bool:
    for _ in range(int(timeout / 0.01)):
        if cond():
            return True
        await asyncio.sleep(0.01)
    return cond()


async def _engine_request(engine: AsyncEngine, rid: str) -> Any:
    """The engine's own Request object for rid (read on the engine thread)."""
    r = await engine.call(lambda e: e.core.scheduler.requests.get(rid))
    assert r is not None, f"{rid} is not in the engine"
    return r


async def _started(engine: AsyncEngine, call, rid: str) -> tuple[Any, list]:
    """Read the first response of a long request; returns its engine Request (running, holding blocks)."""
    first = await call.read()
    assert first.token_ids and not first.finished
    r = await _engine_request(engine, rid)
    assert r.status == RequestStatus.RUNNING and engine.get_stats()["kv_blocks_used"] > 0
    return r, [first]


async def _ended_in_engine(engine: AsyncEngine, r: Any) -> None:
    """The request was aborted in the engine (not run to its end) and every KV block is free again."""
    assert await _until(lambda: r.status.finished)
    assert r.status == RequestStatus.FINISHED_ABORTED and len(r.output_token_ids) < LONG
    assert await _until(lambda: engine.get_stats()["kv_blocks_used"] == 0 and engine.get_stats()["num_running"] == 0)


def serve(engine: AsyncEngine, test, role="both", hold: tuple[str, ...] = (), **server_kw) -> None:
    """Run test(stub, server, channel) against a fresh in-process worker around `engine`; the
    requests named in hold stop after their first output until ended (engine_hold.py)."""
    async def main():
        server, port = await start_worker_server(engine, role, port=0, **server_kw)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                await test(worker_pb2_grpc.WorkerStub(ch), server, ch)
        finally:
            await server.stop(None)
    with EngineHold(engine, *hold):
        asyncio.run(main())


def test_stream_stats_and_info(engine: AsyncEngine, reference: CompletionOutput, demo_model: str) -> None:
    async def t(stub, server, ch):
        out = [r async for r in stub.Generate(req("g1"))]
        assert [tok for r in out for tok in r.token_ids] == list(reference.token_ids)
        assert "".join(r.text for r in out) == reference.text
        assert [r.finished for r in out] == [False] * (len(out) - 1) + [True]
        assert out[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert (out[-1].usage.prompt_tokens, out[-1].usage.completion_tokens) == (len(PROMPT), NUM_REF)
        unary = [r async for r in stub.Generate(req("g2", stream=False))]
        assert len(unary) == 1 and list(unary[0].token_ids) == list(reference.token_ids)
        assert unary[0].text == reference.text and unary[0].usage.completion_tokens == NUM_REF
        stats = await stub.Stats(worker_pb2.StatsRequest())
        total = engine.get_stats()["kv_blocks_total"]
        assert stats.num_kv_blocks_total == total > 0 and stats.num_kv_blocks_used == 0
        assert stats.num_running == 0 and stats.kv_events_endpoint == "" and stats.worker_id == server.worker_id
        info = await stub.GetInfo(worker_pb2.GetInfoRequest())
        assert info.model == demo_model and list(info.eos_token_ids) == list(engine.engine.eos_token_ids)
        assert info.max_model_len == MAX_MODEL_LEN and info.num_kv_blocks_total == total
        assert info.role == common_pb2.WORKER_ROLE_BOTH
        assert engine.engine.output_processor.keep_finished is False  # a service keeps no results
    serve(engine, t)


def test_client_cancel_aborts_in_engine(engine: AsyncEngine) -> None:
    async def t(stub, server, ch):
        call = stub.Generate(req("c1", max_tokens=LONG))
        r, _ = await _started(engine, call, "c1")
        call.cancel()
        await _ended_in_engine(engine, r)
        assert await _until(lambda: server.servicer.num_inflight == 0)
    serve(engine, t, hold=("c1",))


def test_deadline_aborts_in_engine(engine: AsyncEngine) -> None:
    async def t(stub, server, ch):
        call = stub.Generate(req("d1", max_tokens=LONG), timeout=3.0)  # time for the first token; held after it
        r, _ = await _started(engine, call, "d1")
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await read_rest(call)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await _ended_in_engine(engine, r)
        assert await _until(lambda: server.servicer.num_inflight == 0)
    serve(engine, t, hold=("d1",))


def test_abort_rpc_and_duplicate_id(engine: AsyncEngine) -> None:
    async def t(stub, server, ch):
        call = stub.Generate(req("a1", max_tokens=LONG))
        r, seen = await _started(engine, call, "a1")
        with pytest.raises(grpc.aio.AioRpcError) as e:
            _ = [x async for x in stub.Generate(req("a1"))]
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert r.status == RequestStatus.RUNNING  # the refused duplicate left the original alone
        resp = await stub.Abort(common_pb2.AbortRequest(request_ids=["a1", "nope"]))
        assert list(resp.aborted_request_ids) == ["a1"]  # unknown ids are not errors
        seen += await read_rest(call)
        assert seen[-1].finished and seen[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
        assert seen[-1].usage.completion_tokens == sum(len(x.token_ids) for x in seen) < LONG
        await _ended_in_engine(engine, r)
    serve(engine, t, hold=("a1",))


def test_stop_aborts_inflight_streams(engine: AsyncEngine) -> None:
    async def t(stub, server, ch):
        call = stub.Generate(req("s1", max_tokens=LONG))
        r, _ = await _started(engine, call, "s1")
        await server.stop(grace=1.0)
        rest = await read_rest(call)
        assert rest[-1].finished and rest[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
        await _ended_in_engine(engine, r)
    serve(engine, t, hold=("s1",))


def test_dead_engine_is_unavailable_and_not_serving(demo_model: str, reference: CompletionOutput) -> None:
    """A second real engine serves, then its thread is shut down: the worker says so."""
    dead = AsyncEngine.from_engine_args(_engine_args(demo_model))

    async def t(stub, server, ch):
        health = health_pb2_grpc.HealthStub(ch)
        check = health_pb2.HealthCheckRequest(service="pdcluster.v1.Worker")
        assert (await health.Check(check)).status == health_pb2.HealthCheckResponse.SERVING
        out = [r async for r in stub.Generate(req("x1"))]
        assert [tok for r in out for tok in r.token_ids] == list(reference.token_ids)
        await asyncio.to_thread(dead.shutdown)
        assert not dead.is_healthy
        with pytest.raises(grpc.aio.AioRpcError) as e:
            _ = [r async for r in stub.Generate(req("x2"))]
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        for _ in range(1500):  # up to 30 s on a slow machine
            status = (await health.Check(check)).status
            if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
            await asyncio.sleep(0.02)
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING

    try:
        serve(dead, t)
    finally:
        dead.shutdown()


@pytest.mark.parametrize("role, refused, message, proto_role", [
    (DecodeRole("p2p"), {"do_remote_decode": True}, "does not serve prefill legs", common_pb2.WORKER_ROLE_DECODE),
    (PrefillRole("p2p"), {"do_remote_prefill": True, "producer_id": "p", "num_tokens": 2},
     "does not serve decode legs", common_pb2.WORKER_ROLE_PREFILL),
], ids=["decode", "prefill"])
def test_role_refuses_other_leg_serves_local(engine: AsyncEngine, reference: CompletionOutput, role, refused: dict,
                                             message: str, proto_role: int) -> None:
    async def t(stub, server, ch):
        kv = common_pb2.KvTransferParams(**refused)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            _ = [r async for r in stub.Generate(req(f"{role.name}-leg", kv_transfer_params=kv))]
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert message in e.value.details()
        # A request without kv_transfer_params is an ordinary local one, served by every role.
        out = [r async for r in stub.Generate(req(f"{role.name}-local"))]
        assert [tok for r in out for tok in r.token_ids] == list(reference.token_ids)
        info = await stub.GetInfo(worker_pb2.GetInfoRequest())
        assert info.role == proto_role and info.kv_connector == "p2p"
        assert (await stub.Stats(worker_pb2.StatsRequest())).role == proto_role
    serve(engine, t, role=role)


def test_role_strings(engine: AsyncEngine) -> None:
    with pytest.raises(ValueError, match="PrefillRole"):
        asyncio.run(start_worker_server(engine, "prefill"))
    with pytest.raises(ValueError, match="DecodeRole"):
        asyncio.run(start_worker_server(engine, "decode"))
    with pytest.raises(ValueError, match="RoleHandler"):
        asyncio.run(start_worker_server(engine, "router"))


# -- TLS -----------------------------------------------------------------------------------------
async def _health(port: int, creds: grpc.ChannelCredentials | None) -> int:
    target = f"localhost:{port}"
    ch = grpc.aio.secure_channel(target, creds) if creds else grpc.aio.insecure_channel(target)
    async with ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)
        return resp.status


async def _generate_tokens(port: int, creds: grpc.ChannelCredentials, rid: str) -> list[int]:
    async with grpc.aio.secure_channel(f"localhost:{port}", creds) as ch:
        return [t async for r in worker_pb2_grpc.WorkerStub(ch).Generate(req(rid), timeout=30) for t in r.token_ids]


@pytest.mark.parametrize("mutual", [False, True])
def test_tls(engine: AsyncEngine, reference: CompletionOutput, certs: pathlib.Path, mutual: bool) -> None:
    server_tls = TLSConfig(cert=str(certs / "server.pem"), key=str(certs / "server.key"),
                           ca=str(certs / "ca.pem") if mutual else None)
    with_cert = channel_credentials(TLSConfig(ca=str(certs / "ca.pem"), cert=str(certs / "client.pem"),
                                              key=str(certs / "client.key")))
    no_cert = channel_credentials(TLSConfig(ca=str(certs / "ca.pem")))

    async def main():
        server, port = await start_worker_server(engine, "both", tls=server_tls)
        try:
            assert await _health(port, with_cert) == health_pb2.HealthCheckResponse.SERVING
            assert await _generate_tokens(port, with_cert, f"tls-{mutual}") == list(reference.token_ids)
            refused = [None] + ([no_cert] if mutual else [])  # plaintext always; no client cert under mTLS
            for creds in refused:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await _health(port, creds)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            if not mutual:
                assert await _health(port, no_cert) == health_pb2.HealthCheckResponse.SERVING
        finally:
            await server.stop(None)
    asyncio.run(main())


def test_tls_config_errors(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="together"):
        TLSConfig(cert="a.pem")
    (tmp_path / "x.pem").write_text("not pem")
    with pytest.raises(ValueError, match="not PEM"):
        channel_credentials(TLSConfig(ca=str(tmp_path / "x.pem")))
