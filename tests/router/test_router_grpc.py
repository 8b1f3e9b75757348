"""The router's gRPC frontend against fake workers: streaming, validation, admission, retries,
cancellation, deadlines, health ejection and re-admission, load spreading."""

from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdcluster._proto import common_pb2, router_pb2

SP = common_pb2.SamplingParams


def gen(stub, timeout: float = 10.0, **kw) -> list[router_pb2.GenerateResponse]:
    kw.setdefault("prompt_token_ids", router_pb2.TokenIds(ids=[5, 6, 7]))
    kw.setdefault("stream", True)
    return list(stub.Generate(router_pb2.GenerateRequest(**kw), timeout=timeout))


def assert_good(stub) -> None:
    out = gen(stub, sampling_params=SP(max_tokens=2))
    assert out[-1].finished and out[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


def wait_until(cond, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_stream_and_unary(fake_cluster):
    c = fake_cluster(1)
    out = gen(c.stub, sampling_params=SP(max_tokens=4), return_prompt_token_ids=True, request_id="r-1")
    assert [list(r.token_ids) for r in out] == [[8], [9], [10], [11]]
    assert list(out[0].prompt_token_ids) == [5, 6, 7]
    last = out[-1]
    assert last.request_id == "r-1" and last.usage.completion_tokens == 4 and last.usage.prompt_tokens == 3
    assert last.route.decode_worker_id == "w0" and not last.route.disaggregated and last.first_token_time > 0
    (one,) = gen(c.stub, sampling_params=SP(max_tokens=3), stream=False)
    assert list(one.token_ids) == [8, 9, 10] and one.finished
    # A text prompt is tokenized by the router; the worker sees token ids.
    gen(c.stub, prompt_token_ids=None, prompt="Hello world", sampling_params=SP(max_tokens=1))
    tok = c.router.preprocessor.tokenizer
    assert list(c.workers[0].requests[-1].prompt_token_ids) == tok.encode("Hello world")
    # Chat messages are rendered with the model's template.
    chat = router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role="user", content="Hi")],
                                   add_generation_prompt=True)
    gen(c.stub, prompt_token_ids=None, chat=chat, sampling_params=SP(max_tokens=1))
    expected = tok.apply_chat_template([{"role": "user", "content": "Hi"}], True, True)
    assert list(c.workers[0].requests[-1].prompt_token_ids) == expected


BAD_INPUTS = [
    ({"prompt_token_ids": None}, grpc.StatusCode.INVALID_ARGUMENT, "input"),
    ({"prompt_token_ids": router_pb2.TokenIds(ids=[])}, grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids"),
    ({"prompt_token_ids": router_pb2.TokenIds(ids=[10**6])}, grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids"),
    ({"sampling_params": SP(temperature=-1)}, grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    ({"sampling_params": SP(top_p=0)}, grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    ({"sampling_params": SP(n=2)}, grpc.StatusCode.INVALID_ARGUMENT, "n"),
    ({"sampling_params": SP(max_tokens=0)}, grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    ({"sampling_params": SP(max_tokens=4, min_tokens=5)}, grpc.StatusCode.INVALID_ARGUMENT, "min_tokens"),
    ({"sampling_params": SP(max_tokens=10**6)}, grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    ({"sampling_params": SP(logprobs=100)}, grpc.StatusCode.INVALID_ARGUMENT, "logprobs"),
    ({"sampling_params": SP(stop=[""])}, grpc.StatusCode.INVALID_ARGUMENT, "stop"),
    ({"request_id": "x" * 300}, grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
    ({"model": "no-such-model"}, grpc.StatusCode.NOT_FOUND, "model"),
    ({"prompt_token_ids": None,
      "chat": router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role="wizard", content="x")])},
     grpc.StatusCode.INVALID_ARGUMENT, "messages"),
    ({"prompt_token_ids": None, "chat": router_pb2.ChatMessages()}, grpc.StatusCode.INVALID_ARGUMENT, "messages"),
]


@pytest.mark.parametrize("kw,code,field", BAD_INPUTS, ids=[b[2] + str(i) for i, b in enumerate(BAD_INPUTS)])
def test_bad_input_matrix(fake_cluster, kw, code, field):
    c = fake_cluster(1)
    with pytest.raises(grpc.RpcError) as e:
        gen(c.stub, **kw)
    assert e.value.code() == code
    assert field in e.value.details()
    assert not c.workers[0].requests, "a refused request must not reach a worker"
    assert_good(c.stub)


def test_oversize_message_and_garbage_bytes(fake_cluster):
    c = fake_cluster(1, max_message_bytes=64 << 10)
    with pytest.raises(grpc.RpcError) as e:
        gen(c.stub, prompt_token_ids=None, prompt="x" * (100 << 10))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    host, port = c.router.grpc_address.rsplit(":", 1)
    for junk in (b"\x00\xff" * 5000, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\xff" * 50):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(junk)
            s.settimeout(1)
            try:
                s.recv(1024)
            except (TimeoutError, ConnectionError):
                pass
    assert_good(c.stub)


def test_admission_control_answers_resource_exhausted(fake_cluster):
    c = fake_cluster(1, worker_opts=[{"token_delay_s": 0.05}], max_inflight=2)
    streams = [c.stub.Generate(router_pb2.GenerateRequest(prompt_token_ids=router_pb2.TokenIds(ids=[1]),
                                                          sampling_params=SP(max_tokens=40), stream=True), timeout=10)
               for _ in range(2)]
    for s in streams:
        next(s)  # both admitted and running
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        gen(c.stub)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() - t0 < 1.0
    for s in streams:
        s.cancel()
    assert wait_until(lambda: c.lt.call(lambda: c.router.orchestrator.num_inflight) == 0)
    assert_good(c.stub)


def test_cancel_mid_stream_aborts_on_worker(fake_cluster):
    c = fake_cluster(1, worker_opts=[{"token_delay_s": 0.02}])
    stream = c.stub.Generate(router_pb2.GenerateRequest(request_id="cancel-me", prompt_token_ids=router_pb2.TokenIds(
        ids=list(range(40))), sampling_params=SP(max_tokens=200), stream=True), timeout=10)
    next(stream)
    assert c.workers[0].running  # holds KV blocks now
    stream.cancel()
    assert wait_until(lambda: not c.workers[0].running)
    assert "cancel-me" in c.workers[0].aborted
    assert_good(c.stub)


def test_deadline_is_forwarded_and_frees_blocks(fake_cluster):
    c = fake_cluster(1, worker_opts=[{"token_delay_s": 0.05}])
    with pytest.raises(grpc.RpcError) as e:
        gen(c.stub, timeout=0.5, request_id="slow", sampling_params=SP(max_tokens=100))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert 0 < c.workers[0].deadlines[-1] <= 0.5  # the worker leg carried the client's deadline
    assert wait_until(lambda: not c.workers[0].running)
    assert "slow" in c.workers[0].aborted
    assert_good(c.stub)


def test_abort_rpc_ends_stream_with_abort(fake_cluster):
    c = fake_cluster(1, worker_opts=[{"token_delay_s": 0.02}])
    stream = c.stub.Generate(router_pb2.GenerateRequest(request_id="ab-1", prompt_token_ids=router_pb2.TokenIds(ids=[1]),
                                                        sampling_params=SP(max_tokens=500), stream=True), timeout=10)
    next(stream)
    resp = c.stub.Abort(common_pb2.AbortRequest(request_ids=["ab-1", "unknown"]), timeout=5)
    assert list(resp.aborted_request_ids) == ["ab-1"]
    last = list(stream)[-1]
    assert last.finished and last.finish_reason == common_pb2.FINISH_REASON_ABORT
    assert wait_until(lambda: not c.workers[0].running)


def test_retry_before_first_token_only(fake_cluster):
    c = fake_cluster(2, worker_opts=[{"fail_codes": ["UNAVAILABLE"]}, {}])  # round robin: w0 first
    out = gen(c.stub, sampling_params=SP(max_tokens=2))  # w0 fails before any token: retried on w1
    assert out[-1].finished and out[-1].route.num_retries == 1 and out[-1].route.decode_worker_id == "w1"
    assert len(c.healthy_ids()) == 1  # UNAVAILABLE ejected the failed worker at once
    assert c.wait_healthy(2)  # and its next SERVING health check re-admits it
    c2 = fake_cluster(2, worker_opts=[{"fail_after_tokens": 2}, {"fail_after_tokens": 2}])
    out = gen(c2.stub, sampling_params=SP(max_tokens=5))
    assert [len(r.token_ids) for r in out[:2]] == [1, 1]
    assert out[-1].finish_reason == common_pb2.FINISH_REASON_ERROR and "UNAVAILABLE" in out[-1].error_message
    assert sum(len(w.requests) for w in c2.workers) == 1, "no retry after the first token"


def test_worker_errors_on_the_request_reach_the_client(fake_cluster):
    c = fake_cluster(2, worker_opts=[{"fail_codes": ["INVALID_ARGUMENT"]}, {"fail_codes": ["INVALID_ARGUMENT"]}])
    with pytest.raises(grpc.RpcError) as e:
        gen(c.stub)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert sum(len(w.requests) for w in c.workers) == 1  # not retried: the request is at fault
    assert len(c.healthy_ids()) == 2


def test_health_ejection_and_readmission(fake_cluster):
    c = fake_cluster(2, policy="least_loaded")
    health = health_pb2_grpc.HealthStub(c.channel)
    port = c.stop_worker(0)
    assert wait_until(lambda: c.healthy_ids() == {"w1"})
    for _ in range(4):
        assert gen(c.stub, sampling_params=SP(max_tokens=1))[-1].route.decode_worker_id == "w1"
    entries = {w.worker_id: w for w in c.stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=5).workers}
    assert not entries["w0"].healthy and entries["w1"].healthy and entries["w1"].stats.worker_id == "w1"
    c.stop_worker(1)
    assert wait_until(lambda: not c.healthy_ids())
    with pytest.raises(grpc.RpcError) as e:
        gen(c.stub)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert wait_until(lambda: health.Check(health_pb2.HealthCheckRequest(service="pdcluster.v1.Router")).status
                      == health_pb2.HealthCheckResponse.NOT_SERVING)
    c.restart_worker(0, port)
    assert wait_until(lambda: c.healthy_ids() == {"w0"})
    assert gen(c.stub, sampling_params=SP(max_tokens=1))[-1].route.decode_worker_id == "w0"
    assert health.Check(health_pb2.HealthCheckRequest(service="pdcluster.v1.Router")).status \
        == health_pb2.HealthCheckResponse.SERVING


def test_least_loaded_spreads_load(fake_cluster):
    c = fake_cluster(3, worker_opts=[{"token_delay_s": 0.05}] * 3, policy="least_loaded")
    streams = [c.stub.Generate(router_pb2.GenerateRequest(prompt_token_ids=router_pb2.TokenIds(ids=[1]),
                                                          sampling_params=SP(max_tokens=20), stream=True), timeout=10)
               for _ in range(6)]
    firsts = [next(s) for s in streams]
    assert firsts
    counts = [len(w.requests) for w in c.workers]
    assert counts == [2, 2, 2]
    for s in streams:
        s.cancel()


def test_concurrent_streams_are_independent(fake_cluster):
    c = fake_cluster(2, worker_opts=[{"token_delay_s": 0.005}] * 2)
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        out = gen(c.stub, prompt_token_ids=router_pb2.TokenIds(ids=[100 + i]), sampling_params=SP(max_tokens=8))
        results[i] = [t for r in out for t in r.token_ids]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert results == {i: list(range(101 + i, 109 + i)) for i in range(8)}


def test_tls_frontends(fake_cluster, tmp_path):
    import shutil
    import ssl
    import subprocess
    import urllib.request

    from pdcluster.service.tls import TLSConfig, channel_credentials

    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=tmp_path, check=True, capture_output=True)

    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=ca")
    (tmp_path / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    openssl("req", *ec, "-keyout", "s.key", "-out", "s.csr", "-subj", "/CN=router")
    openssl("x509", "-req", "-in", "s.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out", "s.pem",
            "-days", "2", "-extfile", "san.ext")
    c = fake_cluster(1, tls=TLSConfig(cert=str(tmp_path / "s.pem"), key=str(tmp_path / "s.key")))
    assert c.http_url.startswith("https://")
    creds = channel_credentials(TLSConfig(ca=str(tmp_path / "ca.pem")))
    with grpc.secure_channel(c.router.grpc_address, creds) as ch:
        from pdcluster._proto import router_pb2_grpc

        assert_good(router_pb2_grpc.RouterStub(ch))
    with pytest.raises(grpc.RpcError):  # plaintext is refused
        gen(c.stub, timeout=3)
    ctx = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
    with urllib.request.urlopen(c.http_url + "/health", context=ctx, timeout=5) as resp:
        assert resp.status == 200
