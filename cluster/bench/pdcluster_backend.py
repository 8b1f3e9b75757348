"""The `pdcluster` backend: gRPC streaming straight to our router through `pdcluster.client`.

Talks to the router without the HTTP/SSE layer, so it measures the cluster rather than the
OpenAI frontend, and it can send token ids, so prompt lengths are exact. Each streamed delta
(`.token_ids`, `.text`, `.finish_reason`) is one chunk: TTFT ends at the first delta that
carries tokens, every later one adds an ITL gap, and output tokens are counted from the ids.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import Any

from pdcluster.cluster.bench.backend import Backend, BackendConfig
from pdcluster.cluster.bench.request import BenchRequest, RequestResult


def _describe(e: BaseException) -> str:
    # grpc.aio.AioRpcError's str() is a multi-line dump; its status code and details say it all.
    code, details = getattr(e, "code", None), getattr(e, "details", None)
    if callable(code) and callable(details):
        try:
            return f"{type(e).__name__}: {code()}: {details()}"
        except Exception:  # an exception type that only looks like an RPC error
            pass
    return f"{type(e).__name__}: {e}"


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class PdclusterBackend(Backend):
    def __init__(self, config: BackendConfig, client_factory: Callable[[str], Any] | None = None) -> None:
        super().__init__(config)
        self._client_factory = client_factory
        self._client: Any = None
        self._entered = False
        self.model = config.model

    async def start(self) -> None:
        factory = self._client_factory
        if factory is None:
            try:
                from pdcluster.client import AsyncClient  # grpc only when this backend is used
            except ImportError as e:
                raise ValueError(f"--backend pdcluster needs pdcluster.client.AsyncClient: {e}") from e
            factory = AsyncClient
        self._client = factory(self.config.target)
        if hasattr(self._client, "__aenter__"):
            await self._client.__aenter__()
            self._entered = True

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is None:
            return
        if self._entered:
            await client.__aexit__(None, None, None)
        elif hasattr(client, "close"):
            await _maybe_await(client.close())

    def sampling_params(self, req: BenchRequest) -> Any:
        from pdcluster.sampling_params import SamplingParams

        return SamplingParams(max_tokens=req.expected_output_len, temperature=self.config.temperature,
                              ignore_eos=self.config.ignore_eos)

    async def request(self, req: BenchRequest) -> RequestResult:
        assert self._client is not None, "start() the backend first"
        result = RequestResult(prompt_len=req.prompt_len)
        st = last = time.perf_counter()
        result.start_time = st
        pieces: list[str] = []
        num_tokens = num_chunks = 0
        try:
            params = self.sampling_params(req)
            async for delta in self._client.generate_stream(req.prompt, params, request_id=req.request_id):
                now = time.perf_counter()
                ids = list(getattr(delta, "token_ids", None) or ())
                text = getattr(delta, "text", None) or ""
                if not ids and not text:
                    continue  # e.g. a final delta that only carries the finish reason
                if num_chunks == 0:
                    result.ttft = now - st
                else:
                    result.itl.append(now - last)
                last = now
                num_chunks += 1
                num_tokens += len(ids)
                pieces.append(text)
            result.generated_text = "".join(pieces)
            result.output_len = num_tokens or None  # no ids streamed: count the text instead
            result.success = num_chunks > 0
            result.latency = last - st
            if not result.success:
                result.error = "the stream ended without any generated token"
                result.latency = time.perf_counter() - st
        except Exception as e:  # a failed request is data, not a crash
            result.success = False
            result.error = _describe(e)
            result.latency = time.perf_counter() - st
        return result
