"""OpenAI-compatible HTTP backends (`openai`: /v1/completions, `openai-chat`: /v1/chat/completions),
streamed over server-sent events.

Timing follows vLLM's benchmark: TTFT is send -> first chunk carrying text, each later text chunk
adds one ITL gap, E2EL ends at the last text chunk (not at `[DONE]`). Chunks without text (the
chat role announcement, a bare finish marker) are not tokens, so they neither start the TTFT
clock nor add an ITL gap. Token counts come from the final usage chunk
(`stream_options.include_usage`) when the server sends it.
"""

from __future__ import annotations

import base64
import json
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from yarl import URL

from pdcluster.cluster.bench.backend import Backend, BackendConfig
from pdcluster.cluster.bench.request import BenchRequest, RequestResult

MAX_ERROR_BODY = 2000


class StreamError(Exception):
    """The server reported an error inside the stream."""


class OpenAIBackend(Backend):
    def __init__(self, config: BackendConfig, chat: bool = False) -> None:
        super().__init__(config)
        self.chat = chat
        self.model = config.model
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        # limit=0: aiohttp caps a session at 100 connections by default, which would silently cap
        # the offered concurrency; --max-concurrency is the only cap the benchmark should have.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=self.config.request_timeout),
        )
        if self.model is None:
            self.model = await self._first_served_model()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _headers(self, request_id: str = "") -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if key := os.environ.get("OPENAI_API_KEY"):
            headers["Authorization"] = f"Bearer {key}"
        if request_id:  # lets server logs and traces be matched with the result file
            headers["X-Request-Id"] = request_id
        return headers

    async def _first_served_model(self) -> str:
        """--model not given: ask the server (GET /v1/models), as vLLM does."""
        assert self._session is not None
        url = URL(self.config.target).origin() / "v1" / "models"
        async with self._session.get(url, headers=self._headers()) as resp:
            if resp.status != 200:
                raise ValueError(f"--model not given and GET {url} answered HTTP {resp.status}")
            models = (await resp.json()).get("data") or []
        if not models:
            raise ValueError(f"--model not given and {url} lists no model")
        return str(models[0]["id"])

    def payload(self, req: BenchRequest) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "temperature": self.config.temperature, "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.chat:
            if not isinstance(req.prompt, str):
                raise ValueError("--backend openai-chat needs text prompts, not token ids")
            content: Any = req.prompt
            if req.images:  # vLLM's order: the text part, then one image_url part per image
                content = [{"type": "text", "text": req.prompt}, *map(_image_part, req.images)]
            body["messages"] = [{"role": "user", "content": content}]
            body["max_completion_tokens"] = req.expected_output_len
        else:
            if req.images:
                raise ValueError("images (--dataset-name random-mm) need --backend openai-chat")
            body["prompt"] = req.prompt  # the completions API takes text or a list of token ids
            body["max_tokens"] = req.expected_output_len
        if self.config.ignore_eos:
            body["ignore_eos"] = True  # a vLLM/SGLang extension: fixed-length outputs
        return body

    def _chunk_text(self, choice: dict[str, Any]) -> str:
        if not self.chat:
            return choice.get("text") or ""
        delta = choice.get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or delta.get("reasoning") or "")

    async def request(self, req: BenchRequest) -> RequestResult:
        assert self._session is not None, "start() the backend first"
        result = RequestResult(prompt_len=req.prompt_len)
        st = last = time.perf_counter()
        result.start_time = st
        try:
            body = self.payload(req)
            async with self._session.post(self.config.target, json=body,
                                          headers=self._headers(req.request_id)) as resp:
                if resp.status != 200:
                    text = (await resp.text())[:MAX_ERROR_BODY]
                    result.error = f"HTTP {resp.status} {resp.reason or ''}: {text}".strip()
                    result.latency = time.perf_counter() - st
                    return result
                pieces: list[str] = []
                async for data in _sse_data(resp):
                    now = time.perf_counter()
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise StreamError(json.dumps(chunk["error"])[:MAX_ERROR_BODY])
                    if usage := chunk.get("usage"):
                        if usage.get("completion_tokens") is not None:
                            result.output_len = int(usage["completion_tokens"])
                        if usage.get("prompt_tokens") is not None:  # the server's count wins, as in vLLM
                            result.prompt_len = int(usage["prompt_tokens"])
                    choices = chunk.get("choices") or []
                    text = self._chunk_text(choices[0]) if choices else ""
                    if not text:
                        continue
                    if not pieces:
                        result.ttft = now - st
                    else:
                        result.itl.append(now - last)
                    last = now
                    pieces.append(text)
            result.generated_text = "".join(pieces)
            result.latency = last - st
            result.success = bool(pieces)
            if not pieces:
                result.error = "the stream ended without any generated text"
                result.latency = time.perf_counter() - st
        except Exception as e:  # a failed request is data, not a crash
            result.success = False
            result.error = f"{type(e).__name__}: {e}"
            result.latency = time.perf_counter() - st
        return result


def _image_part(image: bytes) -> dict[str, Any]:
    mime = "image/png" if image.startswith(b"\x89PNG") else "image/jpeg"
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{base64.b64encode(image).decode()}"}}


async def _sse_data(resp: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """The `data:` payloads of an SSE stream, up to `[DONE]`. Comments (`:` lines, used as
    keep-alive pings) and other fields (`event:`, `id:`) carry no tokens."""
    async for raw in resp.content:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        yield data
