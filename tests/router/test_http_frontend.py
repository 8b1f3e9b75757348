"""The OpenAI-compatible HTTP frontend in front of real `serve-worker` processes (demo model,
CPU), driven by the official `openai` package and by raw HTTP for the malformed cases. Texts are
checked against the offline engine; freed KV blocks against the worker's own Stats."""

from __future__ import annotations

import http.client
import json
import socket
import threading

import openai
import pytest
from real_router_cluster import WORKER_MAX_MODEL_LEN, wait_until, worker_stats

# A long request under a "held-" id (X-Request-Id): the worker holds it after its first tokens
# (real_router_cluster.HELD_CLI), so it runs until it is ended from outside, however fast the
# machine; a cancelled one cannot finish by itself, so the window only has to suit a slow machine.
LONG = 210
ABORT_WINDOW_S = 30.0
RETRIES = ("pdcluster_router_retries_total", {"role": "decode"})


def client(c) -> openai.OpenAI:
    return openai.OpenAI(base_url=c.http_url + "/v1", api_key="unused", max_retries=0, timeout=30)


def _conn(c) -> http.client.HTTPConnection:
    host, port = c.http_url.removeprefix("http://").rsplit(":", 1)
    return http.client.HTTPConnection(host, int(port), timeout=30)


def post(c, path: str, body: bytes | dict, headers: dict | None = None) -> tuple[int, dict]:
    conn = _conn(c)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    return resp.status, json.loads(raw) if raw else {}


def get(c, path: str) -> tuple[int, str]:
    conn = _conn(c)
    conn.request("GET", path)
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    return resp.status, text


def good(c) -> int:
    return post(c, "/v1/completions", {"prompt": [1], "max_tokens": 1})[0]


def test_health_and_metrics(cluster):
    # Checks every 0.5 s, two misses eject: only the failed request ejects the killed worker.
    c = cluster(2, health_interval_s=0.5, health_timeout_s=0.3, eject_after_failures=2)
    first, second = c.workers  # round robin: a fresh router picks workers[0] first
    assert get(c, "/health")[0] == 200
    assert c.wait_settled()
    first.kill()
    assert post(c, "/v1/completions", {"prompt": [1], "max_tokens": 2, "ignore_eos": True})[0] == 200  # retried
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
    second.pause()  # the last worker hangs: its checks time out
    assert wait_until(lambda: get(c, "/health")[0] == 503)


def test_model_root_is_the_path_asked_of_a_worker(cluster, demo_model):
    """A router started without --model (as under `up`) learns the path from a worker; its model
    card's root names that path rather than null."""
    c = cluster(1, model=None)
    models = client(c).models.list().data
    assert [m.id for m in models] == [demo_model] and models[0].root == demo_model


def test_several_served_model_names_are_all_listed_and_served(cluster):
    """vLLM's --served-model-name a b: both listed, either accepted, any other name a 404."""
    c = cluster(1, served_model_name=("llama", "llama-3"))
    oa = client(c)
    assert [m.id for m in oa.models.list().data] == ["llama", "llama-3"]
    for name in ("llama", "llama-3"):
        assert oa.completions.create(model=name, prompt="Hi", max_tokens=1).model == name
    with pytest.raises(openai.NotFoundError):
        oa.completions.create(model="other", prompt="Hi", max_tokens=1)
    from pdcluster.cluster.cli import build_parser
    from pdcluster.cluster.router_cmd import router_config

    args = build_parser().parse_args(["router", "--workers", "127.0.0.1:1", "--served-model-name", "a", "b"])
    assert router_config(args, ("127.0.0.1:1",), None, None).served_model_name == ("a", "b")


def test_openai_completions(cluster, reference):
    c = cluster(1)
    oa = client(c)
    model = oa.models.list().data[0].id
    assert oa.models.retrieve(model).id == model  # GET /v1/models/{model}
    with pytest.raises(openai.NotFoundError):
        oa.models.retrieve("no-such-model")
    code, text = get(c, "/version")
    assert code == 200 and json.loads(text)["version"]
    assert model == c.router.preprocessor.model_name
    greedy = {"temperature": 0, "extra_body": {"ignore_eos": True}}
    r = oa.completions.create(model=model, prompt=[5, 6, 7], max_tokens=3, **greedy)
    assert r.choices[0].text == reference.generate([5, 6, 7], max_tokens=3).text
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (3, 3, 6)
    chunks = list(oa.completions.create(model=model, prompt="Hello", max_tokens=3, stream=True,
                                        stream_options={"include_usage": True}, **greedy))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == reference.generate("Hello", max_tokens=3).text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    # vLLM's extra sampling fields travel to the worker: a seeded sample using all of them is the
    # offline engine's sample with the same parameters (and not the one without them).
    extra = {"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "ignore_eos": True, "min_tokens": 1,
             "stop_token_ids": [3], "seed": 7}
    r = oa.completions.create(model=model, prompt=[1, 2], max_tokens=8, temperature=0.9, extra_body=extra)
    want = reference.generate([1, 2], max_tokens=8, temperature=0.9, **extra)
    assert r.choices[0].text == want.text
    assert want.text != reference.generate([1, 2], max_tokens=8, temperature=0.9, seed=7).text
    # A stop token id ends a greedy generation where the offline engine ends it.
    first_two = reference.tokens([1], 2)
    r = oa.completions.create(model=model, prompt=[1], max_tokens=6, temperature=0,
                              extra_body={"ignore_eos": True, "stop_token_ids": [first_two[-1]]})
    want = reference.generate([1], max_tokens=6, stop_token_ids=[first_two[-1]])
    assert len(want.token_ids) <= 2 and r.usage.completion_tokens == len(want.token_ids)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == want.text


def test_openai_chat(cluster, reference):
    c = cluster(1)
    oa = client(c)
    model = c.router.preprocessor.model_name
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    greedy = {"temperature": 0, "extra_body": {"ignore_eos": True}}
    r = oa.chat.completions.create(model=model, messages=msgs, max_tokens=2, **greedy)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == reference.chat(msgs, max_tokens=2).text
    prompt_len = len(c.router.preprocessor.tokenizer.apply_chat_template(msgs, True, True))
    assert r.usage.prompt_tokens == prompt_len
    chunks = list(oa.chat.completions.create(model=model, messages=msgs, max_tokens=3, stream=True, **greedy))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == reference.chat(msgs, max_tokens=3).text
    assert chunks[-1].choices[0].finish_reason == "length"
    # Without max_tokens a chat request may use the rest of the context (OpenAI's default)...
    r = oa.chat.completions.create(model=model, messages=msgs, **greedy)
    assert r.usage.completion_tokens == WORKER_MAX_MODEL_LEN - prompt_len and r.choices[0].finish_reason == "length"
    # ... and vLLM clients may pass it in the body instead.
    r = oa.chat.completions.create(model=model, messages=msgs, max_tokens=None, stream=False,
                                   extra_body={"max_tokens": 4, "ignore_eos": True})
    assert r.usage.completion_tokens == 4


def test_worker_failure_before_and_after_output(cluster):
    """The only worker dies with two requests on it: a non-streaming one (the client saw nothing
    yet: retryable, so 503 as no other worker can take it) and a streaming one that already sent
    tokens (an error event, then [DONE]; never retried)."""
    c = cluster(1)
    worker = c.workers[0]
    conn = _conn(c)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": [1], "max_tokens": LONG, "stream": True,
                                                            "ignore_eos": True}),
                 headers={"X-Request-Id": "held-fail-stream"})
    resp = conn.getresponse()
    assert resp.status == 200
    line = b""
    while not line.startswith(b"data: "):
        line = resp.readline()
        assert line, "the stream ended before its first event"
    assert json.loads(line[len(b"data: "):])["choices"][0]["finish_reason"] is None
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(r=post(c, "/v1/completions", {
        "prompt": [2], "max_tokens": LONG, "ignore_eos": True}, {"X-Request-Id": "held-fail-unary"})))
    t.start()
    assert wait_until(lambda: worker_stats(worker.address).num_running == 2)
    worker.kill()
    t.join(30)
    code, err = result["r"]
    assert code == 503 and "UNAVAILABLE" in err["error"]["message"]
    text = resp.read().decode()
    conn.close()
    events = [ln[len("data: "):] for ln in text.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]" and "UNAVAILABLE" in json.loads(events[-2])["error"]["message"]
    assert all("error" not in json.loads(e) for e in events[:-2])
    assert c.metric(*RETRIES) == 1  # the non-streaming request's attempt; the stream's was never tried


BAD_BODIES = [
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "x", "temperature": 500}, 400, "temperature"),
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10**7}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 256}, 400, "max_tokens"),  # the workers' max_model_len
    ({"prompt": "x", "top_k": 1.5}, 400, "top_k"),
    ({"prompt": "x", "n": 0}, 400, "n"),  # n > 1 and echo are served (issue 18): their bounds
    ({"prompt": "x", "echo": True, "logprobs": 1, "stream": True}, 400, "echo"),  # served whole, not streamed
    ({"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    ({"prompt": "x", "stop": [1]}, 400, "stop"),
    ({"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ({"prompt": "x", "ignore_eos": "yes"}, 400, "ignore_eos"),
    ({"prompt": "x", "seed": -5}, 400, "seed"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": ["a", [1.5]]}, 400, "prompt"),  # batches are served; a bad member is refused
    ({"prompt": [1, 2, 10**9]}, 400, "prompt_token_ids"),
    ({"prompt": {"a": 1}}, 400, "prompt"),
    ({}, 400, "prompt"),
    ({"prompt": "x", "model": "gpt-9"}, 404, "model"),
]


@pytest.mark.parametrize("body,status,param", BAD_BODIES, ids=[b[2] + str(i) for i, b in enumerate(BAD_BODIES)])
def test_bad_completion_bodies(cluster, body, status, param):
    c = cluster(1)
    code, err = post(c, "/v1/completions", body)
    assert code == status, err
    assert err["error"]["param"] == param and err["error"]["code"] == status and err["error"]["message"]
    assert good(c) == 200


BAD_CHAT = [
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": "yes"}, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
]


@pytest.mark.parametrize("body,param", BAD_CHAT, ids=[b[1] + str(i) for i, b in enumerate(BAD_CHAT)])
def test_bad_chat_bodies(cluster, body, param):
    c = cluster(1)
    code, err = post(c, "/v1/chat/completions", body)
    assert code == 400 and err["error"]["param"] == param
    assert post(c, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1})[0] == 200


def test_malformed_http(cluster):
    c = cluster(1, max_message_bytes=32 << 10)
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
    assert good(c) == 200


def test_admission_control_is_429(cluster):
    c = cluster(1, max_inflight=1)
    oa = client(c)
    stream = oa.completions.create(model=c.router.preprocessor.model_name, prompt=[1], max_tokens=LONG, stream=True,
                                   extra_body={"ignore_eos": True}, extra_headers={"X-Request-Id": "held-429"})
    next(iter(stream))
    code, err = post(c, "/v1/completions", {"prompt": [1], "max_tokens": 1})
    assert code == 429 and err["error"]["type"] == "RateLimitError"
    stream.close()
    assert c.wait_idle(0, ABORT_WINDOW_S)
    assert wait_until(lambda: good(c) == 200)


def _raw_post(s: socket.socket, body: dict, request_id: str) -> None:
    data = json.dumps(body).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Request-Id: "
              + request_id.encode() + b"\r\nContent-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)


def test_client_disconnect_mid_stream_aborts(cluster):
    c = cluster(1)
    host, port = c.http_url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        _raw_post(s, {"prompt": list(range(40)), "max_tokens": LONG, "stream": True, "ignore_eos": True}, "held-gone-1")
        seen = b""
        while b"data: " not in seen:  # headers and the first event may come in separate segments
            chunk = s.recv(4096)
            assert chunk, "connection closed before the first event"
            seen += chunk
        assert c.stats(0).num_running == 1
    assert c.wait_idle(0, ABORT_WINDOW_S), c.stats(0)
    # Non-streaming too: the handler is cancelled, the worker leg aborted.
    with socket.create_connection((host, int(port)), timeout=5) as s:
        _raw_post(s, {"prompt": [1], "max_tokens": LONG, "ignore_eos": True}, "held-gone-2")
        assert wait_until(lambda: c.stats(0).num_running == 1)
    assert c.wait_idle(0, ABORT_WINDOW_S), c.stats(0)
    cancelled = c.metric("pdcluster_router_requests_total", {"frontend": "http", "status": "CANCELLED"})
    assert cancelled == 2
    assert good(c) == 200


# -- bounds (issue 16): every refusal names the field and the limit -----------------------------
BOUNDED = [
    ({"prompt": "x", "stop_token_ids": list(range(65))}, "stop_token_ids", "64"),
    ({"prompt": "x", "stop_token_ids": list(range(100_000))}, "stop_token_ids", "1024"),
    ({"prompt": "x", "stop_token_ids": [10**6]}, "stop_token_ids", "out of range"),
    ({"prompt": "x", "stop": ["s"] * 33}, "stop", "32"),
    ({"prompt": "x", "stop": ["s" * 1025]}, "stop", "1024"),
    ({"prompt": "x", "logprobs": 21}, "logprobs", "20"),
    ({"prompt": "x", "logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "1024"),
    ({"prompt": "x", "n": 17}, "n", "16"),
    ({"prompt": list(range(300))}, "prompt_token_ids", "256"),
]


@pytest.mark.parametrize("body,param,limit", BOUNDED, ids=[b[1] + str(i) for i, b in enumerate(BOUNDED)])
def test_bounded_fields(cluster, body, param, limit):
    c = cluster(1)
    code, err = post(c, "/v1/completions", body)
    assert code == 400, err
    assert err["error"]["param"] == param and limit in err["error"]["message"], err


def test_bounded_chat_fields(cluster):
    c = cluster(1)
    msgs = [{"role": "user", "content": "x"}]
    code, err = post(c, "/v1/chat/completions", {"messages": msgs, "logprobs": True, "top_logprobs": 50})
    assert code == 400 and err["error"]["param"] == "top_logprobs" and "20" in err["error"]["message"]
    code, err = post(c, "/v1/chat/completions", {"messages": msgs * 5000})
    assert code == 400 and err["error"]["param"] == "messages" and "4096" in err["error"]["message"]


def test_deep_json_is_400(cluster):
    c = cluster(1, max_json_depth=16)
    deep = b'{"prompt": "x", "extra": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    code, err = post(c, "/v1/completions", deep)
    assert code == 400 and err["error"]["param"] == "body" and "16" in err["error"]["message"], err
    code, err = post(c, "/v1/completions", b'{"prompt": "x", "extra": ' + b"[" * 20 + b"]" * 20 + b"}")
    assert code == 400 and "16" in err["error"]["message"]
    # Brackets inside strings are not nesting.
    assert post(c, "/v1/completions", {"prompt": "[" * 100, "max_tokens": 1})[0] == 200
    assert good(c) == 200


def test_unpaired_surrogate_escapes_are_400(cluster):
    """JSON can escape half a UTF-16 pair; such a string is not text (no tokenizer, protobuf
    field or UTF-8 writer takes it): refused naming the top-level field, never a 500."""
    c = cluster(1)
    msgs = [{"role": "user", "content": "x"}]
    for path, raw, param in [
        ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 1}', "prompt"),
        ("/v1/completions", b'{"prompt": "a", "max_tokens": 1, "stop": ["\\uDFFF"]}', "stop"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udbff"}], "max_tokens": 1}', "messages"),
    ]:
        code, err = post(c, path, raw)
        assert code == 400 and err["error"]["param"] == param and "surrogate" in err["error"]["message"], err
    # A whole escaped pair is one character: served.
    assert post(c, "/v1/completions", b'{"prompt": "\\ud83d\\ude00", "max_tokens": 1}')[0] == 200
    assert post(c, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1})[0] == 200


def test_opaque_fields_are_type_checked(cluster):
    c = cluster(1)
    msgs = [{"role": "user", "content": "x"}]
    code, err = post(c, "/v1/completions", {"prompt": "x", "max_tokens": 1, "user": 5})
    assert code == 400 and err["error"]["param"] == "user" and "256" in err["error"]["message"], err
    code, err = post(c, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1, "parallel_tool_calls": "x"})
    assert code == 400 and err["error"]["param"] == "parallel_tool_calls", err
    code, err = post(c, "/v1/chat/completions", {"messages": msgs, "max_completion_tokens": 0})
    assert code == 400 and err["error"]["param"] == "max_completion_tokens", err
    assert post(c, "/v1/completions", {"prompt": "x", "max_tokens": 1, "user": "alice"})[0] == 200


def test_prompts_over_the_context_length_are_400(cluster, monkeypatch):
    """Over max_model_len (256 here): the token count is named. A prompt far over it is refused from
    a prefix, never tokenized whole (the tokenizer holds the GIL: a 2 MB prompt tokenized whole held
    the router's loop for 2.2 s), for a plain prompt and for a chat."""
    c = cluster(1)
    limit = c.router.preprocessor.max_model_len
    code, err = post(c, "/v1/completions", {"prompt": "x " * (limit + 20), "max_tokens": 1})
    assert code == 400 and err["error"]["param"] == "prompt" and f"length is {limit}" in err["error"]["message"], err
    tokenizer = c.router.preprocessor.tokenizer
    lengths: list[int] = []
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text, *a, **k: (lengths.append(len(text)), encode(text, *a, **k))[1])
    huge = "def f(x): return x\n" * 50_000  # ~1 MB
    code, err = post(c, "/v1/completions", {"prompt": huge, "max_tokens": 1})
    assert code == 400 and err["error"]["param"] == "prompt" and "more than" in err["error"]["message"], err
    assert lengths and max(lengths) < len(huge) // 10, lengths
    code, err = post(c, "/v1/chat/completions", {"messages": [{"role": "user", "content": huge}], "max_tokens": 1})
    assert code == 400 and err["error"]["param"] == "messages" and "more than" in err["error"]["message"], err
    assert good(c) == 200


def test_params_cache_is_bounded_by_bytes(cluster):
    c = cluster(1, params_cache_bytes=64 << 10)
    for i in range(200):  # distinct parameter sets, each at the stop_token_ids limit
        body = {"prompt": [1], "max_tokens": 1, "stop_token_ids": [i + k for k in range(64)]}
        assert post(c, "/v1/completions", body)[0] == 200
    assert 0 < c.router.preprocessor.params_cache_bytes <= 64 << 10


def test_admission_before_tokenization(cluster):
    c = cluster(1, max_inflight=1)
    calls = []
    pre = c.router.preprocessor
    real = pre.prepare

    async def counting(*a, **kw):
        calls.append(1)
        return await real(*a, **kw)

    pre.prepare = counting
    oa = client(c)
    stream = oa.completions.create(model=pre.model_name, prompt=[1], max_tokens=LONG, stream=True,
                                   extra_body={"ignore_eos": True}, extra_headers={"X-Request-Id": "held-first"})
    next(iter(stream))
    assert len(calls) == 1
    code, err = post(c, "/v1/completions", {"prompt": "a long prompt " * 1000, "max_tokens": 1})
    assert code == 429 and "1 requests in flight" in err["error"]["message"]
    assert len(calls) == 1  # refused before the preprocessor ran
    stream.close()


def test_api_key_with_the_openai_client(cluster):
    c = cluster(1, api_key="sekrit-key")
    model = c.router.preprocessor.model_name
    good_client = openai.OpenAI(base_url=c.http_url + "/v1", api_key="sekrit-key", max_retries=0, timeout=30)
    r = good_client.completions.create(model=model, prompt=[1], max_tokens=1)
    assert r.choices[0].text is not None
    for wrong in ("wrong", "sekrit-ke", "Sekrit-key"):
        bad = openai.OpenAI(base_url=c.http_url + "/v1", api_key=wrong, max_retries=0, timeout=30)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=model, prompt=[1], max_tokens=1)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    code, err = post(c, "/v1/completions", {"prompt": [1], "max_tokens": 1})  # no header at all
    assert code == 401 and err["error"]["code"] == 401
    assert get(c, "/health")[0] == 200 and get(c, "/metrics")[0] == 200  # open, as in vLLM
    # Everything else needs the key: the tokenizer endpoints, odd spellings of the open paths.
    for path in ("/tokenize", "/detokenize"):
        body = {"prompt": "hi"} if path == "/tokenize" else {"tokens": [1]}
        assert post(c, path, body)[0] == 401
        assert post(c, path, body, headers={"Authorization": "Bearer sekrit-key"})[0] == 200
    for path in ("/health/", "//health", "/v1/../tokenize", "/nowhere"):
        assert get(c, path)[0] == 401, path


def test_several_api_keys_each_admit_on_http_and_grpc(cluster):
    """vLLM's --api-key takes several keys: each is let in, on both frontends; anything else is not."""
    import grpc

    from pdcluster._proto import router_pb2, router_pb2_grpc

    c = cluster(1, api_key=("old-key", "new-key"))
    model = c.router.preprocessor.model_name
    for key in ("old-key", "new-key"):
        oa = openai.OpenAI(base_url=c.http_url + "/v1", api_key=key, max_retries=0, timeout=30)
        assert oa.completions.create(model=model, prompt=[1], max_tokens=1).choices
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=c.http_url + "/v1", api_key="old-keynew-key", max_retries=0,
                      timeout=30).models.list()
    req = router_pb2.GenerateRequest(prompt_token_ids=router_pb2.TokenIds(ids=[1]), stream=False)
    req.sampling_params.max_tokens = 1
    with grpc.insecure_channel(c.router.grpc_address) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        for key in ("old-key", "new-key"):
            assert list(stub.Generate(req, metadata=[("authorization", f"Bearer {key}")], timeout=30))
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(req, metadata=[("authorization", "Bearer other")], timeout=30))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    from pdcluster.cluster.cli import build_parser
    from pdcluster.cluster.router_cmd import router_config

    args = build_parser().parse_args(["router", "--workers", "127.0.0.1:1", "--api-key", "a", "b"])
    assert router_config(args, ("127.0.0.1:1",), None, None).api_key == ("a", "b")


def test_compressed_bodies_are_415(cluster):
    """A Content-Encoding other than identity is refused by name, never inflated: aiohttp would
    inflate it on the event loop as it arrives, so a small gzip bomb could hold every request up."""
    import gzip
    import zlib

    c = cluster(1)
    plain = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    bodies = {"gzip": gzip.compress(plain), "deflate": zlib.compress(plain), "br": b"\x0b\x02\x80" + plain,
              "GZIP ": gzip.compress(plain)}
    for encoding, data in bodies.items():
        conn = _conn(c)
        conn.request("POST", "/v1/completions", body=data,
                     headers={"Content-Type": "application/json", "Content-Encoding": encoding})
        resp = conn.getresponse()
        err = json.loads(resp.read())
        conn.close()
        assert resp.status == 415 and err["error"]["param"] == "Content-Encoding", (encoding, err)
        assert resp.getheader("Accept-Encoding") == "identity"
    # A bomb (256 MiB of zeros in ~250 kB) is refused the same way, and the router serves on.
    co = zlib.compressobj(9, zlib.DEFLATED, 31)
    bomb = co.compress(b'{"prompt": "') + b"".join(co.compress(bytes(1 << 20)) for _ in range(256)) + co.flush()
    conn = _conn(c)
    try:
        conn.request("POST", "/v1/completions", body=bomb,
                     headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
        assert conn.getresponse().status == 415
    except ConnectionError:
        pass  # the server may close before taking the whole body; it must not have inflated it
    finally:
        conn.close()
    assert post(c, "/v1/completions", plain, headers={"Content-Encoding": "identity"})[0] == 200
    assert good(c) == 200
