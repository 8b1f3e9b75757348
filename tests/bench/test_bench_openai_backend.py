"""The openai backends against a real aiohttp SSE server with controlled delays."""

from __future__ import annotations

import asyncio
import socket

import pytest

from pdcluster.cluster.bench.backend import BackendConfig, make_backend
from pdcluster.cluster.bench.request import BenchRequest, RequestResult

SLACK = 1.0  # seconds of scheduling noise tolerated on a loaded 2-core machine


async def _send(config: BackendConfig, *reqs: BenchRequest) -> tuple[list[RequestResult], str | None]:
    async with make_backend(config) as backend:
        results = await asyncio.gather(*(backend.request(r) for r in reqs))
        return list(results), backend.model


def test_completions_stream_timings(fake_server) -> None:
    fake_server.ttft, fake_server.itl = 0.05, 0.02
    config = BackendConfig("openai", fake_server.url + "/v1/completions", model="m", ignore_eos=True)
    [r], _ = asyncio.run(_send(config, BenchRequest(" fox dog", 2, 4, request_id="r0")))
    assert r.success, r.error
    assert r.generated_text == " w0 w1 w2 w3"
    assert r.output_len == 4 and r.prompt_len == 2  # from the usage chunk
    assert len(r.itl) == 3  # one gap per chunk after the first; the finish/usage chunks are not tokens
    assert 0.045 <= r.ttft < 0.05 + SLACK
    assert all(0.015 <= gap < 0.02 + SLACK for gap in r.itl)
    assert r.latency == pytest.approx(r.ttft + sum(r.itl))
    body = fake_server.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 4 and body["ignore_eos"] is True and body["model"] == "m"
    assert body["prompt"] == " fox dog" and body["temperature"] == 0.0


def test_chat_ignores_the_role_chunk_and_asks_the_model_name(fake_server) -> None:
    fake_server.ttft, fake_server.itl = 0.05, 0.01
    config = BackendConfig("openai-chat", fake_server.url + "/v1/chat/completions")
    [r], model = asyncio.run(_send(config, BenchRequest("hello there", 2, 3)))
    assert model == "fake-model"  # --model not given: GET /v1/models
    assert r.success, r.error
    assert r.generated_text == " w0 w1 w2" and r.output_len == 3
    assert r.ttft >= 0.045  # the role announcement, sent at once, does not stop the TTFT clock
    assert len(r.itl) == 2
    body = fake_server.bodies[0]
    assert body["messages"] == [{"role": "user", "content": "hello there"}]
    assert body["max_completion_tokens"] == 3 and body["model"] == "fake-model"


def test_without_usage_output_len_is_left_to_the_tokenizer(fake_server) -> None:
    fake_server.usage, fake_server.ttft, fake_server.itl = False, 0.0, 0.0
    config = BackendConfig("openai", fake_server.url + "/v1/completions", model="m")
    [r], _ = asyncio.run(_send(config, BenchRequest([1, 2, 3], 3, 2)))
    assert r.success and r.output_len is None and r.prompt_len == 3
    assert fake_server.bodies[0]["prompt"] == [1, 2, 3]  # token ids go through as a list


def test_failures_are_recorded_not_raised(fake_server) -> None:
    fake_server.ttft, fake_server.itl = 0.0, 0.0
    config = BackendConfig("openai", fake_server.url + "/v1/completions", model="m")
    results, _ = asyncio.run(_send(config, BenchRequest("FAIL500", 1, 2), BenchRequest("FAILSTREAM", 1, 3),
                                   BenchRequest("fine", 1, 2)))
    http, stream, ok = results
    assert not http.success and http.error.startswith("HTTP 500") and "boom" in http.error
    assert not stream.success and "worker died" in stream.error
    assert ok.success
    assert http.start_time > 0 and http.latency > 0


def test_chat_rejects_token_ids(fake_server) -> None:
    config = BackendConfig("openai-chat", fake_server.url + "/v1/chat/completions", model="m")
    [r], _ = asyncio.run(_send(config, BenchRequest([1, 2], 2, 2)))
    assert not r.success and "text prompts" in r.error


def test_connection_refused_is_a_failed_request() -> None:
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = BackendConfig("openai", f"http://127.0.0.1:{port}/v1/completions", model="m")
    [r], _ = asyncio.run(_send(config, BenchRequest("x", 1, 2)))
    assert not r.success and r.error
