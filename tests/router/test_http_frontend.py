"""The OpenAI-compatible HTTP frontend against fake workers, driven by the official `openai`
package and by raw HTTP for the malformed cases."""

from __future__ import annotations

import http.client
import json
import socket
import time

import openai
import pytest


def client(c) -> openai.OpenAI:
    return openai.OpenAI(base_url=c.http_url + "/v1", api_key="unused", max_retries=0, timeout=20)


def post(c, path: str, body: bytes | dict, headers: dict | None = None) -> tuple[int, dict]:
    host, port = c.http_url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    return resp.status, json.loads(raw) if raw else {}


def get(c, path: str) -> tuple[int, str]:
    host, port = c.http_url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("GET", path)
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    return resp.status, text


def wait_until(cond, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_openai_completions(fake_cluster):
    c = fake_cluster(1)
    oa = client(c)
    model = oa.models.list().data[0].id
    assert model == c.router.preprocessor.model_name
    r = oa.completions.create(model=model, prompt=[5, 6, 7], max_tokens=3, temperature=0)
    assert r.choices[0].text == "<8><9><10>" and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (3, 3, 6)
    chunks = list(oa.completions.create(model=model, prompt="Hello", max_tokens=3, stream=True,
                                        stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) .count("<") == 3
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    # vLLM's extra sampling fields travel to the worker.
    oa.completions.create(model=model, prompt=[1], max_tokens=2, extra_body={
        "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "ignore_eos": True, "min_tokens": 1,
        "stop_token_ids": [3], "seed": 7})
    sp = c.workers[0].requests[-1].sampling_params
    assert (sp.top_k, sp.ignore_eos, sp.min_tokens, list(sp.stop_token_ids), sp.seed) == (5, True, 1, [3], 7)
    assert sp.min_p == pytest.approx(0.1) and sp.repetition_penalty == pytest.approx(1.2)


def test_openai_chat(fake_cluster):
    c = fake_cluster(1)
    oa = client(c)
    model = c.router.preprocessor.model_name
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    r = oa.chat.completions.create(model=model, messages=msgs, max_tokens=2)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content.count("<") == 2
    expected = c.router.preprocessor.tokenizer.apply_chat_template(msgs, True, True)
    assert list(c.workers[0].requests[-1].prompt_token_ids) == expected
    chunks = list(oa.chat.completions.create(model=model, messages=msgs, max_tokens=3, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks).count("<") == 3
    assert chunks[-1].choices[0].finish_reason == "length"
    # Without max_tokens a chat request may use the rest of the context (OpenAI's default).
    oa.chat.completions.create(model=model, messages=msgs, max_tokens=None, stream=False, extra_body={"max_tokens": 4})
    assert c.workers[0].requests[-1].sampling_params.max_tokens == 4


BAD_BODIES = [
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "x", "temperature": 500}, 400, "temperature"),
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10**7}, 400, "max_tokens"),
    ({"prompt": "x", "top_k": 1.5}, 400, "top_k"),
    ({"prompt": "x", "n": 2}, 400, "n"),
    ({"prompt": "x", "echo": True}, 400, "echo"),
    ({"prompt": "x", "stop": [1]}, 400, "stop"),
    ({"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ({"prompt": "x", "ignore_eos": "yes"}, 400, "ignore_eos"),
    ({"prompt": "x", "seed": -5}, 400, "seed"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": ["a", "b"]}, 400, "prompt"),
    ({"prompt": [1, 2, 10**9]}, 400, "prompt_token_ids"),
    ({"prompt": {"a": 1}}, 400, "prompt"),
    ({}, 400, "prompt"),
    ({"prompt": "x", "model": "gpt-9"}, 404, "model"),
]


@pytest.mark.parametrize("body,status,param", BAD_BODIES, ids=[b[2] + str(i) for i, b in enumerate(BAD_BODIES)])
def test_bad_completion_bodies(fake_cluster, body, status, param):
    c = fake_cluster(1)
    code, err = post(c, "/v1/completions", body)
    assert code == status, err
    assert err["error"]["param"] == param and err["error"]["code"] == status and err["error"]["message"]
    assert post(c, "/v1/completions", {"prompt": [1], "max_tokens": 1})[0] == 200


BAD_CHAT = [
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": "yes"}, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
]


@pytest.mark.parametrize("body,param", BAD_CHAT, ids=[b[1] + str(i) for i, b in enumerate(BAD_CHAT)])
def test_bad_chat_bodies(fake_cluster, body, param):
    c = fake_cluster(1)
    code, err = post(c, "/v1/chat/completions", body)
    assert code == 400 and err["error"]["param"] == param
    assert post(c, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1})[0] == 200


def test_malformed_http(fake_cluster):
    c = fake_cluster(1, max_message_bytes=32 << 10)
    code, err = post(c, "/v1/completions", b"{not json")
    assert code == 400 and err["error"]["param"] == "body"
    code, err = post(c, "/v1/completions", {"prompt": "x" * (64 << 10)})
    assert code == 413 and err["error"]["code"] == 413
    code, err = post(c, "/v1/nothing", {})
    assert code == 404 and "error" in err
    with socket.create_connection(c.http_url.removeprefix("http://").rsplit(":", 1), timeout=5) as s:
        s.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\xaa" * 500)  # a TLS hello
        s.settimeout(2)
        try:
            s.recv(1024)
        except (TimeoutError, ConnectionError):
            pass
    assert post(c, "/v1/completions", {"prompt": [1], "max_tokens": 1})[0] == 200


def test_admission_control_is_429(fake_cluster):
    c = fake_cluster(1, worker_opts=[{"token_delay_s": 0.05}], max_inflight=1)
    oa = client(c)
    stream = oa.completions.create(model=c.router.preprocessor.model_name, prompt=[1], max_tokens=50, stream=True)
    next(iter(stream))
    code, err = post(c, "/v1/completions", {"prompt": [1], "max_tokens": 1})
    assert code == 429 and err["error"]["type"] == "RateLimitError"
    stream.close()


def test_client_disconnect_mid_stream_aborts(fake_cluster):
    c = fake_cluster(1, worker_opts=[{"token_delay_s": 0.02}])
    host, port = c.http_url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"prompt": list(range(40)), "max_tokens": 500, "stream": True}).encode()
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"X-Request-Id: gone-1\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        seen = b""
        while b"data: " not in seen:  # headers and the first event may come in separate segments
            chunk = s.recv(4096)
            assert chunk, "connection closed before the first event"
            seen += chunk
    assert wait_until(lambda: "gone-1" in c.workers[0].aborted and not c.workers[0].running)
    # Non-streaming too: the handler is cancelled, the worker leg aborted.
    body = json.dumps({"prompt": [1], "max_tokens": 500}).encode()
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"X-Request-Id: gone-2\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert wait_until(lambda: c.workers[0].running)
    assert wait_until(lambda: "gone-2" in c.workers[0].aborted and not c.workers[0].running)
    assert post(c, "/v1/completions", {"prompt": [1], "max_tokens": 1})[0] == 200


def test_health_and_metrics(fake_cluster):
    c = fake_cluster(2, worker_opts=[{"fail_codes": ["UNAVAILABLE"]}, {}])
    assert get(c, "/health")[0] == 200
    assert post(c, "/v1/completions", {"prompt": [1], "max_tokens": 2})[0] == 200  # retried once
    post(c, "/v1/completions", {"prompt": "x", "temperature": -1})
    status, text = get(c, "/metrics")
    assert status == 200
    for needle in ('pdcluster_router_requests_total{frontend="http",status="OK"} 1.0',
                   'pdcluster_router_requests_total{frontend="http",status="INVALID_ARGUMENT"} 1.0',
                   'pdcluster_router_retries_total{role="decode"} 1.0',
                   "pdcluster_router_time_to_first_token_seconds_count 1.0",
                   "pdcluster_router_inter_token_latency_seconds_count 1.0",
                   'pdcluster_router_worker_inflight{address=', "pdcluster_router_worker_queue_depth{",
                   'pdcluster_router_errors_total{code="INVALID_ARGUMENT"} 1.0'):
        assert needle in text, needle
    c.stop_worker(0)
    c.stop_worker(1)
    assert wait_until(lambda: get(c, "/health")[0] == 503)


def test_worker_failure_before_and_after_output(fake_cluster):
    c = fake_cluster(1, worker_opts=[{"fail_after_tokens": 1}])
    # Not streaming: the client saw nothing yet, so it is a retryable failure -> 503 when no
    # other worker can take it.
    code, err = post(c, "/v1/completions", {"prompt": [1], "max_tokens": 4})
    assert code == 503 and "UNAVAILABLE" in err["error"]["message"]
    assert c.wait_healthy(1)
    # Streaming: one token went out, so the stream ends with an error event, then [DONE].
    host, port = c.http_url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": [1], "max_tokens": 4, "stream": True}))
    resp = conn.getresponse()
    text = resp.read().decode()
    assert resp.status == 200 and '"text":"<2>"' in text
    assert '"error"' in text and text.rstrip().endswith("data: [DONE]")
