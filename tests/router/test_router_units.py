"""Pure pieces of the router: circuit breaker, config, conversions, OpenAI parsing."""

from __future__ import annotations

import grpc
import pytest

from pdcluster._proto import common_pb2, worker_pb2
from pdcluster.router.circuit_breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from pdcluster.router.config import RouterConfig, parse_worker_list
from pdcluster.router.convert import response_from_worker, sampling_params_from_proto
from pdcluster.router.errors import RouterError, invalid
from pdcluster.router.kv_sync import _endpoint_for
from pdcluster.router.openai_protocol import parse_chat, parse_completion


def test_circuit_breaker_states():
    b = CircuitBreaker(3)
    assert b.state == OPEN and not b.allows_traffic  # not checked yet
    assert b.record_health(True) and b.state == HALF_OPEN and b.allows_traffic
    b.record_success()
    assert b.state == CLOSED
    assert not b.record_failure() and not b.record_failure() and b.state == CLOSED
    b.record_success()  # resets the consecutive count
    assert not b.record_failure() and not b.record_failure()
    assert b.record_failure() and b.state == OPEN and b.num_ejections == 1
    assert not b.record_failure()  # already open: no second ejection
    b.record_health(True)
    assert b.state == HALF_OPEN
    assert b.record_failure() and b.state == OPEN  # one failure while half open re-opens
    b.record_health(True)
    b.record_health(True)
    assert b.state == CLOSED
    assert b.record_failure(fatal=True) and b.state == OPEN  # a failed RPC ejects at once
    breaker = CircuitBreaker(2, start_open=False)
    breaker.record_health(False)
    breaker.record_health(False)
    assert breaker.state == OPEN


def test_config_validation():
    assert parse_worker_list(" a:1, b:2 ,") == ("a:1", "b:2")
    for bad in ("nohost", "h:0", "h:x", ":5"):
        with pytest.raises(ValueError, match="workers"):
            parse_worker_list(bad)
    with pytest.raises(ValueError, match="policy"):
        RouterConfig(policy="random")
    with pytest.raises(ValueError, match="max_inflight"):
        RouterConfig(max_inflight=0)
    with pytest.raises(ValueError, match="grpc_port"):
        RouterConfig(grpc_port=70000)


def test_sampling_params_validation_names_the_field():
    assert sampling_params_from_proto(common_pb2.SamplingParams()).max_tokens == 16
    params = sampling_params_from_proto(common_pb2.SamplingParams(top_k=-1, stop=["x"], seed=3, temperature=0))
    assert (params.top_k, params.stop, params.seed, params.temperature) == (0, ("x",), 3, 0.0)
    for message, field in [(common_pb2.SamplingParams(top_p=2), "top_p"),
                      (common_pb2.SamplingParams(repetition_penalty=0), "repetition_penalty"),
                      (common_pb2.SamplingParams(presence_penalty=5), "presence_penalty")]:
        with pytest.raises(RouterError) as e:
            sampling_params_from_proto(message)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.field == field


def test_response_conversion_keeps_every_field():
    w = worker_pb2.WorkerGenerateResponse(request_id="w", token_ids=[1, 2], text="ab", token_arrival_times=[1.0, 2.0],
                                          finished=True, finish_reason=common_pb2.FINISH_REASON_STOP, stop_str="b",
                                          usage=common_pb2.Usage(prompt_tokens=3, completion_tokens=2))
    w.logprobs.add().sampled.logprob = -0.5
    w.kv_transfer_params.block_ids.append(7)  # field 12: must not leak into the client's message
    r = response_from_worker(w, "client-id")
    assert (r.request_id, list(r.token_ids), r.text, r.finished, r.stop_str) == ("client-id", [1, 2], "ab", True, "b")
    assert r.usage.prompt_tokens == 3 and r.logprobs[0].sampled.logprob == -0.5 and not r.prompt_token_ids


def test_errors_map_to_http():
    assert invalid("top_p", "bad").openai_body()["error"] == {
        "message": "top_p: bad", "type": "BadRequestError", "param": "top_p", "code": 400}
    assert RouterError(grpc.StatusCode.NOT_FOUND, "x", "model").http_status == 404
    assert RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED, "x").http_status == 429
    assert RouterError(grpc.StatusCode.UNAVAILABLE, "x").http_status == 503
    assert RouterError(grpc.StatusCode.INVALID_ARGUMENT, "x", http_status=413).openai_body()["error"]["code"] == 413


def test_kv_endpoint_wildcards_resolve_to_worker_host():
    assert _endpoint_for("tcp://0.0.0.0:5555", "10.0.0.2") == "tcp://10.0.0.2:5555"
    assert _endpoint_for("tcp://127.0.0.1:5555", "10.0.0.2") == "tcp://127.0.0.1:5555"


def test_openai_parsing():
    req, opts = parse_completion({"prompt": [[1, 2]], "max_tokens": 3, "stop": "x", "logprobs": 2,
                                  "stream": True, "stream_options": {"include_usage": True}, "user": "u"}, "m")
    assert list(req.prompt_token_ids.ids) == [1, 2] and req.sampling_params.max_tokens == 3
    assert list(req.sampling_params.stop) == ["x"] and req.sampling_params.logprobs == 2
    assert opts.stream and opts.include_usage and opts.model == "m" and not opts.chat
    req, opts = parse_chat({"model": "x", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                                    {"type": "text", "text": "b"}]}],
                            "logprobs": True, "top_logprobs": 3, "max_completion_tokens": 9}, "m")
    assert req.chat.messages[0].content == "ab" and req.sampling_params.logprobs == 3
    assert req.sampling_params.max_tokens == 9 and opts.model == "x" and opts.chat
    assert not req.sampling_params.HasField("temperature")  # unset stays unset
    with pytest.raises(RouterError, match="body"):
        parse_completion([1, 2], "m")
