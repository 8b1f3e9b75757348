"""`pdcluster serve-worker` as a real process: tokens equal offline, cancellation and deadlines
free every block, bad input gets the right status and leaves the worker serving."""

from __future__ import annotations

import socket
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdcluster._proto import common_pb2, worker_pb2

PROMPTS = [[5, 6, 7, 8, 9], [42, 17, 300, 2, 11, 99, 4], [7] * 20]


def gen_request(ids, rid: str = "", stream: bool = True, **sp) -> worker_pb2.WorkerGenerateRequest:
    sp.setdefault("temperature", 0.0)
    sp.setdefault("max_tokens", 8)
    sp.setdefault("ignore_eos", True)
    return worker_pb2.WorkerGenerateRequest(request_id=rid, prompt_token_ids=ids, stream=stream,
                                            sampling_params=common_pb2.SamplingParams(**sp))


def wait_idle(stub, timeout: float = 10.0) -> common_pb2.WorkerStats:
    """Stats once nothing runs and every KV block is free (blocks may stay prefix-cached)."""
    end = time.monotonic() + timeout
    while True:
        s = stub.Stats(worker_pb2.StatsRequest(), timeout=5)
        idle = s.num_running == 0 and s.num_waiting == 0 and s.num_kv_blocks_used == 0
        if idle or time.monotonic() > end:
            return s
        time.sleep(0.05)


def assert_good_request_works(stub) -> None:
    out = list(stub.Generate(gen_request([1, 2, 3], max_tokens=2), timeout=30))
    assert out[-1].finished and sum(len(r.token_ids) for r in out) == 2


def test_undecodable_requests_are_invalid_argument(worker, stub) -> None:
    """Bytes that are no WorkerGenerateRequest / GetInfoRequest: INVALID_ARGUMENT naming the type
    (pdcluster/grpc_decode.py); the worker serves on."""
    with grpc.insecure_channel(worker.address) as ch:
        generate = ch.unary_stream("/pdcluster.v1.Worker/Generate", request_serializer=lambda b: b,
                                   response_deserializer=lambda b: b)
        info = ch.unary_unary("/pdcluster.v1.Worker/GetInfo", request_serializer=lambda b: b,
                              response_deserializer=lambda b: b)
        for junk in (b"\x0a\x02\xff\xfe", b"\xff" * 32):
            with pytest.raises(grpc.RpcError) as e:
                list(generate(junk, timeout=30))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "pdcluster.v1.WorkerGenerateRequest" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            info(b"\xff" * 32, timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "GetInfoRequest" in e.value.details()
    assert_good_request_works(stub)


def test_health_serving(worker) -> None:
    with grpc.insecure_channel(worker.address) as ch:
        h = health_pb2_grpc.HealthStub(ch)
        for service in ("", "pdcluster.v1.Worker"):
            resp = h.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_ready_line_and_info(worker, stub) -> None:
    ready = worker.ready
    assert ready["worker_id"] == "w-test" and ready["role"] == "both" and ready["address"].startswith("127.0.0.1:")
    assert ready["kv_events_endpoint"].startswith("tcp://127.0.0.1:") and ready["kv_events_public_key"]
    info = stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5)
    assert info.worker_id == "w-test" and info.role == common_pb2.WORKER_ROLE_BOTH
    assert info.max_model_len == 256 and info.block_size == 16 and info.engine_epoch == ready["epoch"]
    assert info.kv_events_endpoint == ready["kv_events_endpoint"]


def test_stream_equals_offline(worker, stub, demo_model: str) -> None:
    from pdcluster import LLM, SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    offline = LLM(demo_model, max_model_len=256).generate(PROMPTS, sp)
    calls = [stub.Generate(gen_request(p, f"eq-{i}", max_tokens=12), timeout=60) for i, p in enumerate(PROMPTS)]
    for call, ref in zip(calls, offline):  # issued together: the worker batches them
        responses = list(call)
        assert [t for r in responses for t in r.token_ids] == ref.outputs[0].token_ids
        assert "".join(r.text for r in responses) == ref.outputs[0].text
        last = responses[-1]
        assert last.finished and last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert last.usage.completion_tokens == 12 and last.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert all(len(r.token_arrival_times) == len(r.token_ids) for r in responses)


def test_non_streaming_is_one_response(stub) -> None:
    responses = list(stub.Generate(gen_request(PROMPTS[0], stream=False, max_tokens=5), timeout=30))
    assert len(responses) == 1 and len(responses[0].token_ids) == 5 and responses[0].finished


def test_cancel_mid_stream_frees_blocks(stub) -> None:
    # "held-": the worker holds it after its first deltas (engine_hold.py), so it is still running.
    call = stub.Generate(gen_request(list(range(3, 40)), "held-cancel-me", max_tokens=200), timeout=60)
    for i, _ in enumerate(call):
        if i == 2:
            break
    during = stub.Stats(worker_pb2.StatsRequest(), timeout=5)
    call.cancel()
    assert during.num_kv_blocks_used > 0
    s = wait_idle(stub)
    assert s.num_running == 0 and s.num_kv_blocks_used == 0 and s.num_kv_blocks_free == s.num_kv_blocks_total


def test_deadline_exceeded_frees_blocks(stub) -> None:
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(gen_request(list(range(50, 60)), "held-late", max_tokens=240), timeout=0.4))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    s = wait_idle(stub)
    assert s.num_running == 0 and s.num_kv_blocks_used == 0


def test_abort_rpc_ends_stream(stub) -> None:
    call = stub.Generate(gen_request([9, 8, 7], "held-abort-me", max_tokens=240), timeout=60)
    first = next(call)
    assert not first.finished
    resp = stub.Abort(common_pb2.AbortRequest(request_ids=["held-abort-me", "unknown-id"]), timeout=5)
    assert list(resp.aborted_request_ids) == ["held-abort-me"]
    last = list(call)[-1]
    assert last.finished and last.finish_reason == common_pb2.FINISH_REASON_ABORT
    assert wait_idle(stub).num_kv_blocks_used == 0


BAD = {
    "empty prompt": (gen_request([]), grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids"),
    "token outside vocab": (gen_request([1, 10**6]), grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids[1]"),
    "max_tokens 0": (gen_request([1], max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    "negative temperature": (gen_request([1], temperature=-0.5), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    "top_p 1.5": (gen_request([1], top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    "prompt too long": (gen_request([1] * 300), grpc.StatusCode.INVALID_ARGUMENT, "max_model_len"),
    "oversize message": (gen_request([2**31] * 300_000), grpc.StatusCode.RESOURCE_EXHAUSTED, ""),
    "remote prefill, no connector": (
        worker_pb2.WorkerGenerateRequest(prompt_token_ids=[1], kv_transfer_params=common_pb2.KvTransferParams(
            do_remote_prefill=True, producer_id="p", num_tokens=1)),
        grpc.StatusCode.FAILED_PRECONDITION, "no KV connector"),
    "contradictory kv params": (
        worker_pb2.WorkerGenerateRequest(prompt_token_ids=[1], kv_transfer_params=common_pb2.KvTransferParams(
            do_remote_prefill=True, do_remote_decode=True)),
        grpc.StatusCode.INVALID_ARGUMENT, "exclusive"),
    "foreign eos ids": (worker_pb2.WorkerGenerateRequest(prompt_token_ids=[1], eos_token_ids=[3, 4]),
                        grpc.StatusCode.INVALID_ARGUMENT, "eos_token_ids"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input(stub, case: str) -> None:
    request, code, needle = BAD[case]
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(request, timeout=30))
    assert e.value.code() == code, e.value.details()
    assert needle in (e.value.details() or "")
    assert_good_request_works(stub)


def _send_garbage(host: str, port: int) -> None:
    for payload in (b"\x00" * 64, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", bytes(range(256)) * 16):
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(payload)
            s.settimeout(0.5)
            try:
                s.recv(1024)
            except (TimeoutError, ConnectionError, OSError):
                pass


def test_garbage_bytes_do_not_take_the_worker_down(worker, stub) -> None:
    host, port = worker.address.rsplit(":", 1)
    _send_garbage(host, int(port))
    for endpoint in (worker.ready["kv_events_endpoint"], worker.ready["kv_snapshot_endpoint"]):
        h, p = endpoint.removeprefix("tcp://").rsplit(":", 1)
        _send_garbage(h, int(p))
    assert worker.proc.poll() is None
    assert_good_request_works(stub)
    s = stub.Stats(worker_pb2.StatsRequest(), timeout=5)
    assert s.kv_events_endpoint == worker.ready["kv_events_endpoint"]
