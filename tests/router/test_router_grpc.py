"""The router's gRPC frontend in front of real `serve-worker` processes (demo model, CPU):
streaming, validation, admission, retries, cancellation, deadlines, health ejection and
re-admission, load spreading. Tokens are checked against the offline engine; freed KV blocks
against the worker's own Stats."""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request
import uuid

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from real_router_cluster import is_idle, wait_until, worker_stats

from pdcluster._proto import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc

SamplingParams = common_pb2.SamplingParams
LENGTH, ERROR, ABORT = common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_ERROR, common_pb2.FINISH_REASON_ABORT
# A long generation under a "held-" id: the worker holds it after its first tokens
# (real_router_cluster.HELD_CLI), so it runs until it is ended from outside, however fast the
# machine. A cancelled one must be gone from the worker within ABORT_WINDOW_S: it cannot end by
# itself, so the bound only has to be generous for a slow machine.
LONG = 210
ABORT_WINDOW_S = 30.0
AGGREGATED = ("pdcluster_router_disaggregated_requests_total", {"mode": "aggregated"})
# The router's two ways to reach a worker: one multiplexed stream (default), a call per request.
CHANNELS = pytest.mark.parametrize("channel", ["stream", "call"])
RETRIES = ("pdcluster_router_retries_total", {"role": "decode"})


def sampling(max_tokens: int, **kwargs) -> common_pb2.SamplingParams:
    """Greedy and exactly max_tokens long: comparable with the offline engine."""
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kwargs)


def gen(stub, timeout: float = 30.0, **kwargs) -> list[router_pb2.GenerateResponse]:
    kwargs.setdefault("prompt_token_ids", router_pb2.TokenIds(ids=[5, 6, 7]))
    kwargs.setdefault("stream", True)
    kwargs.setdefault("sampling_params", sampling(2))
    return list(stub.Generate(router_pb2.GenerateRequest(**kwargs), timeout=timeout))


def tokens(out) -> list[int]:
    return [t for r in out for t in r.token_ids]


def long_stream(stub, request_id: str = "", ids=(1,), max_tokens: int = LONG, timeout: float = 60.0):
    """request_id: a "held-" one (the default: a fresh one) or the stream may end by itself."""
    request_id = request_id or f"held-{uuid.uuid4().hex[:12]}"
    return stub.Generate(router_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=router_pb2.TokenIds(ids=list(ids)), sampling_params=sampling(max_tokens),
        stream=True), timeout=timeout)


def assert_good(stub) -> None:
    out = gen(stub, sampling_params=sampling(2))
    assert out[-1].finished and out[-1].finish_reason == LENGTH and len(tokens(out)) == 2


@CHANNELS
def test_stream_and_unary(cluster, reference, channel):
    c = cluster(1, worker_channel=channel)
    want = reference.generate([5, 6, 7], max_tokens=4)
    out = gen(c.stub, sampling_params=sampling(4), return_prompt_token_ids=True, request_id="r-1")
    assert [list(r.token_ids) for r in out] == [[t] for t in want.token_ids]  # one delta per token
    assert "".join(r.text for r in out) == want.text
    assert list(out[0].prompt_token_ids) == [5, 6, 7]
    last = out[-1]
    assert last.request_id == "r-1" and last.finish_reason == LENGTH
    assert last.usage.completion_tokens == 4 and last.usage.prompt_tokens == 3
    assert last.route.decode_worker_id == c.workers[0].worker_id and not last.route.disaggregated
    assert last.first_token_time > 0
    (one,) = gen(c.stub, sampling_params=sampling(3), stream=False)
    assert list(one.token_ids) == list(want.token_ids[:3]) and one.finished
    # A text prompt is tokenized by the router; the worker generates from those ids.
    tok = c.router.preprocessor.tokenizer
    out = gen(c.stub, prompt_token_ids=None, prompt="Hello world", sampling_params=sampling(3), return_prompt_token_ids=True)
    assert list(out[0].prompt_token_ids) == tok.encode("Hello world")
    assert tokens(out) == reference.tokens("Hello world", 3)
    # Chat messages are rendered with the model's template.
    messages = [{"role": "user", "content": "Hi"}]
    chat = router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(**m) for m in messages], add_generation_prompt=True)
    out = gen(c.stub, prompt_token_ids=None, chat=chat, sampling_params=sampling(3), return_prompt_token_ids=True)
    assert list(out[0].prompt_token_ids) == tok.apply_chat_template(messages, True, True)
    assert tokens(out) == list(reference.chat(messages, max_tokens=3).token_ids)
    # The prompt-shaping fields: a final message continued; a text prompt without BOS.
    messages.append({"role": "assistant", "content": "Well"})
    chat = router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(**m) for m in messages],
                                   continue_final_message=True)
    out = gen(c.stub, prompt_token_ids=None, chat=chat, sampling_params=sampling(2), return_prompt_token_ids=True)
    assert list(out[0].prompt_token_ids) == tok.apply_chat_template(messages, False, True, continue_final_message=True)
    out = gen(c.stub, prompt_token_ids=None, prompt="Hello world", add_special_tokens=False,
              sampling_params=sampling(2), return_prompt_token_ids=True)
    assert list(out[0].prompt_token_ids) == tok.encode("Hello world", add_special_tokens=False)
    for bad, field in [(dict(add_special_tokens=True), "add_special_tokens"),
                       (dict(prompt_token_ids=None, chat=router_pb2.ChatMessages(
                           messages=chat.messages, continue_final_message=True, add_generation_prompt=True)),
                        "continue_final_message")]:
        with pytest.raises(grpc.RpcError) as e:
            gen(c.stub, sampling_params=sampling(2), **bad)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()


def test_prompt_logprobs_on_the_first_response(cluster, reference):
    from pdcluster import SamplingParams

    c = cluster(1)
    want = reference.llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=3,
                                                                 prompt_logprobs=2))[0].prompt_logprobs
    sp = sampling(3)
    sp.prompt_logprobs = 2
    for stream in (True, False):
        out = gen(c.stub, prompt_token_ids=router_pb2.TokenIds(ids=[5, 6, 7, 8]), sampling_params=sp, stream=stream)
        got = out[0].prompt_logprobs
        assert [e.sampled.token_id for e in got] == [6, 7, 8] and all(not r.prompt_logprobs for r in out[1:])
        assert [e.sampled.logprob for e in got] == pytest.approx([w.sampled.logprob for w in want], abs=1e-4)
        assert [[t.token_id for t in e.top] for e in got] == [[t.token_id for t in w.top] for w in want]
    sp.prompt_logprobs = 21
    with pytest.raises(grpc.RpcError) as e:
        gen(c.stub, sampling_params=sp)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_logprobs" in e.value.details()


def test_least_loaded_spreads_load(cluster):
    c = cluster(3, policy="least_loaded")
    streams = [long_stream(c.stub) for _ in range(6)]
    try:
        for s in streams:
            next(s)
        assert [c.stats(i).num_running for i in range(3)] == [2, 2, 2]
    finally:
        for s in streams:
            s.cancel()
    assert all(c.wait_idle(i, ABORT_WINDOW_S) for i in range(3))


def test_concurrent_streams_are_independent(cluster, reference):
    c = cluster(2)
    prompts = {i: [100 + i, 7, 8 + i] for i in range(8)}
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        out = gen(c.stub, prompt_token_ids=router_pb2.TokenIds(ids=prompts[i]), sampling_params=sampling(8))
        results[i] = tokens(out)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [results.get(i) for i in range(8)] == reference.batch_tokens([prompts[i] for i in range(8)], 8)


def test_worker_errors_on_the_request_reach_the_client(cluster):
    """A request the worker refuses -- its id is already running there (another router, or a
    client talking to the worker directly) -- fails with the worker's status and words, is not
    retried, and does not count against the worker."""
    c = cluster(2)
    channels = [grpc.insecure_channel(w.address) for w in c.workers]
    try:
        held = [worker_pb2_grpc.WorkerStub(channel).Generate(worker_pb2.WorkerGenerateRequest(
            request_id="held-dup-1", prompt_token_ids=[1], sampling_params=sampling(LONG), stream=True), timeout=60)
            for channel in channels]
        for h in held:
            next(h)
        with pytest.raises(grpc.RpcError) as e:
            gen(c.stub, request_id="held-dup-1")
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "already running here" in e.value.details()  # the worker's message, passed through
        assert c.metric(*RETRIES) == 0  # not retried: the request is at fault
        assert len(c.healthy_ids()) == 2
        # The HTTP frontend maps it too.
        req = urllib.request.Request(c.http_url + "/v1/completions", data=b'{"prompt": [1], "max_tokens": 2}',
                                     headers={"Content-Type": "application/json", "X-Request-Id": "held-dup-1"})
        with pytest.raises(urllib.error.HTTPError) as http_error:
            urllib.request.urlopen(req, timeout=10)
        assert http_error.value.code == 409 and b"already running here" in http_error.value.read()
        for h in held:
            h.cancel()
    finally:
        for channel in channels:
            channel.close()
    assert c.wait_idle(0, ABORT_WINDOW_S) and c.wait_idle(1, ABORT_WINDOW_S)
    assert_good(c.stub)


@CHANNELS
def test_retry_before_first_token_only(cluster, reference, channel):
    # Failed checks alone would take 50 probes to eject: only the failed request does it here.
    c = cluster(2, eject_after_failures=50, worker_channel=channel)
    first, second = c.workers  # round robin: a fresh router picks workers[0] first
    assert c.wait_settled()
    first.kill()
    out = gen(c.stub, sampling_params=sampling(4))  # the first pick fails before any token: retried
    assert tokens(out) == reference.tokens([5, 6, 7], 4)
    assert out[-1].route.num_retries == 1 and out[-1].route.decode_worker_id == second.worker_id
    assert c.metric(*RETRIES) == 1
    assert c.healthy_ids() == {second.worker_id}  # UNAVAILABLE ejected the dead worker at once
    # (Re-admission after a restart: test_health_ejection_and_readmission.)
    # After the first token a failure ends the stream with an error and is not retried, though
    # another worker is there: a retry would repeat output. (With migrations on, the default, the
    # request would continue elsewhere instead: test_migration.py.)
    c = cluster(2, worker_channel=channel, max_migrations=0)
    stream = long_stream(c.stub, "held-no-retry")
    got = [next(stream), next(stream)]
    serving = next(w for w in c.workers if worker_stats(w.address).num_running == 1)
    other = next(w for w in c.workers if w is not serving)
    serving.kill()
    rest = list(stream)
    assert [len(r.token_ids) for r in got] == [1, 1]
    last = rest[-1]
    assert last.finished and last.finish_reason == ERROR and "UNAVAILABLE" in last.error_message
    assert serving.worker_id in last.error_message
    assert c.metric(*RETRIES) == 0, "no retry after the first token"
    assert other.worker_id in c.healthy_ids() and is_idle(other.address)


BAD_INPUTS = [
    ({"prompt_token_ids": None}, grpc.StatusCode.INVALID_ARGUMENT, "input"),
    ({"prompt_token_ids": router_pb2.TokenIds(ids=[])}, grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids"),
    ({"prompt_token_ids": router_pb2.TokenIds(ids=[10**6])}, grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids"),
    ({"sampling_params": SamplingParams(temperature=-1)}, grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    ({"sampling_params": SamplingParams(top_p=0)}, grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    ({"sampling_params": SamplingParams(n=2)}, grpc.StatusCode.INVALID_ARGUMENT, "n"),
    ({"sampling_params": SamplingParams(max_tokens=0)}, grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    ({"sampling_params": SamplingParams(max_tokens=4, min_tokens=5)}, grpc.StatusCode.INVALID_ARGUMENT, "min_tokens"),
    ({"sampling_params": SamplingParams(max_tokens=10**6)}, grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    # The workers' max_model_len (256), learnt from them, not config.json's 2048.
    ({"sampling_params": SamplingParams(max_tokens=254)}, grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    ({"sampling_params": SamplingParams(logprobs=100)}, grpc.StatusCode.INVALID_ARGUMENT, "logprobs"),
    ({"sampling_params": SamplingParams(stop=[""])}, grpc.StatusCode.INVALID_ARGUMENT, "stop"),
    ({"request_id": "x" * 300}, grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
    ({"model": "no-such-model"}, grpc.StatusCode.NOT_FOUND, "model"),
    ({"prompt_token_ids": None,
      "chat": router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role="wizard", content="x")])},
     grpc.StatusCode.INVALID_ARGUMENT, "messages"),
    ({"prompt_token_ids": None, "chat": router_pb2.ChatMessages()}, grpc.StatusCode.INVALID_ARGUMENT, "messages"),
]


@pytest.mark.parametrize("kwargs,code,field", BAD_INPUTS, ids=[b[2] + str(i) for i, b in enumerate(BAD_INPUTS)])
def test_bad_input_matrix(cluster, kwargs, code, field):
    c = cluster(1)
    with pytest.raises(grpc.RpcError) as e:
        gen(c.stub, **kwargs)
    assert e.value.code() == code
    assert field in e.value.details()
    assert c.metric(*AGGREGATED) == 0, "a refused request must not reach a worker"
    assert_good(c.stub)
    assert c.metric(*AGGREGATED) == 1


def test_oversize_message_and_garbage_bytes(cluster):
    c = cluster(1, max_message_bytes=64 << 10)
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


def test_undecodable_protobuf_is_invalid_argument(cluster):
    """Bytes that are no GenerateRequest / AbortRequest (corrupt, truncated, a string field that is
    not UTF-8) get INVALID_ARGUMENT naming the message type (pdcluster/grpc_decode.py), not UNKNOWN."""
    c = cluster(1)
    generate = c.channel.unary_stream("/pdcluster.v1.Router/Generate", request_serializer=lambda b: b,
                                      response_deserializer=lambda b: b)
    abort = c.channel.unary_unary("/pdcluster.v1.Router/Abort", request_serializer=lambda b: b,
                                  response_deserializer=lambda b: b)
    for junk in (b"\x0a\x02\xff\xfe", b"\x0a\x10ab", b"\xff" * 64):
        with pytest.raises(grpc.RpcError) as e:
            list(generate(junk, timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
        assert "pdcluster.v1.GenerateRequest" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            abort(junk, timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "AbortRequest" in e.value.details()
    assert_good(c.stub)


def test_admission_control_answers_resource_exhausted(cluster):
    c = cluster(1, max_inflight=2)
    streams = [long_stream(c.stub) for _ in range(2)]
    for s in streams:
        next(s)  # both admitted and generating
    assert c.stats(0).num_running == 2
    with pytest.raises(grpc.RpcError) as e:
        gen(c.stub)
    # Refused at once, not queued for a slot: the held streams never end by themselves, and both
    # still run now (a queued call would have waited for one and then failed its own deadline).
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value
    assert c.stats(0).num_running == 2
    for s in streams:
        s.cancel()
    assert wait_until(lambda: c.lt.call(lambda: c.router.orchestrator.num_inflight) == 0)
    assert c.wait_idle(0, ABORT_WINDOW_S)
    assert_good(c.stub)


@CHANNELS
def test_cancel_mid_stream_aborts_on_worker(cluster, channel):
    c = cluster(1, worker_channel=channel)
    stream = long_stream(c.stub, "held-cancel-me", ids=range(40))  # 250 tokens in all
    next(stream)
    s = c.stats(0)
    assert s.num_running == 1 and s.num_kv_blocks_used >= 3  # 40 prompt tokens: 3 blocks and growing
    stream.cancel()
    assert c.wait_idle(0, ABORT_WINDOW_S), c.stats(0)
    assert_good(c.stub)


@CHANNELS
def test_deadline_is_forwarded_and_frees_blocks(cluster, channel):
    c = cluster(1, worker_channel=channel)
    worker = c.workers[0]
    deadline_s = 3.0  # time for the first token on a slow machine
    t0 = time.monotonic()
    stream = long_stream(c.stub, "held-slow", ids=range(40), timeout=deadline_s)
    next(stream)
    # Freeze the router's event loop until the worker is idle: it can neither read the worker nor
    # cancel the leg, so only a deadline the leg itself carries can end the request on the
    # worker. And hold the worker (SIGSTOP) past that deadline. The request is held on the worker
    # (it cannot end by itself), so the worker going idle proves the forwarded deadline ended it.
    unfreeze = threading.Event()
    c.lt.loop.call_soon_threadsafe(unfreeze.wait, 120.0)
    try:
        worker.pause()
        time.sleep(max(0.0, t0 + deadline_s + 0.5 - time.monotonic()))
        worker.resume()
        assert wait_until(lambda: is_idle(worker.address), 30), "the worker did not stop at the forwarded deadline"
    finally:
        unfreeze.set()
    with pytest.raises(grpc.RpcError) as e:
        list(stream)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_good(c.stub)  # once the router's loop runs again


@CHANNELS
def test_abort_rpc_ends_stream_with_abort(cluster, channel):
    c = cluster(1, worker_channel=channel)
    stream = long_stream(c.stub, "held-ab-1")
    next(stream)
    resp = c.stub.Abort(common_pb2.AbortRequest(request_ids=["held-ab-1", "unknown"]), timeout=5)
    assert list(resp.aborted_request_ids) == ["held-ab-1"]
    rest = list(stream)
    assert rest[-1].finished and rest[-1].finish_reason == ABORT
    assert 1 + len(tokens(rest)) < LONG
    assert c.wait_idle(0, ABORT_WINDOW_S), c.stats(0)


def test_tls_frontends(cluster, tmp_path):
    import shutil
    import ssl
    import subprocess

    from pdcluster._proto import router_pb2_grpc
    from pdcluster.worker.tls import TLSConfig, channel_credentials

    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    ec_key_args = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=tmp_path, check=True, capture_output=True)

    openssl("req", "-x509", *ec_key_args, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=ca")
    (tmp_path / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    openssl("req", *ec_key_args, "-keyout", "s.key", "-out", "s.csr", "-subj", "/CN=router")
    openssl("x509", "-req", "-in", "s.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out", "s.pem",
            "-days", "2", "-extfile", "san.ext")
    c = cluster(1, tls=TLSConfig(cert=str(tmp_path / "s.pem"), key=str(tmp_path / "s.key")))
    assert c.http_url.startswith("https://")
    creds = channel_credentials(TLSConfig(ca=str(tmp_path / "ca.pem")))
    with grpc.secure_channel(c.router.grpc_address, creds) as channel:
        assert_good(router_pb2_grpc.RouterStub(channel))
    with pytest.raises(grpc.RpcError):  # plaintext is refused
        gen(c.stub, timeout=3)
    ctx = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
    with urllib.request.urlopen(c.http_url + "/health", context=ctx, timeout=5) as resp:
        assert resp.status == 200


def test_health_ejection_and_readmission(cluster):
    c = cluster(2, policy="least_loaded", health_timeout_s=0.3)
    a, b = c.workers
    health = health_pb2_grpc.HealthStub(c.channel)

    def router_health() -> int:
        return health.Check(health_pb2.HealthCheckRequest(service="pdcluster.v1.Router"), timeout=5).status

    a.kill()  # crashed: failed checks eject it
    assert wait_until(lambda: c.healthy_ids() == {b.worker_id})
    for _ in range(4):
        assert gen(c.stub, sampling_params=sampling(1))[-1].route.decode_worker_id == b.worker_id
    entries = {w.worker_id: w for w in c.stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=5).workers}
    assert not entries[a.worker_id].healthy and entries[b.worker_id].healthy
    assert entries[b.worker_id].stats.worker_id == b.worker_id
    b.pause()  # hung (SIGSTOP): its checks time out
    assert wait_until(lambda: not c.healthy_ids())
    with pytest.raises(grpc.RpcError) as e:
        gen(c.stub)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert wait_until(lambda: router_health() == health_pb2.HealthCheckResponse.NOT_SERVING)
    with pytest.raises(urllib.error.HTTPError) as http_error:
        urllib.request.urlopen(c.http_url + "/health", timeout=5)
    assert http_error.value.code == 503
    a.restart()  # a new process on the same port
    assert wait_until(lambda: c.healthy_ids() == {a.worker_id}, 20)
    assert gen(c.stub, sampling_params=sampling(1))[-1].route.decode_worker_id == a.worker_id
    assert router_health() == health_pb2.HealthCheckResponse.SERVING
    b.resume()
    assert wait_until(lambda: c.healthy_ids() == {a.worker_id, b.worker_id})
