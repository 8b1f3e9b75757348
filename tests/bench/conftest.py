"""Fixtures of the bench tests: small real tokenizers and a tiny OpenAI-compatible SSE server."""

from __future__ import annotations

import asyncio
import json
import pathlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web

CORPUS = """
The prefill pool reads the whole prompt at once and writes the key and value cache; the decode
pool then generates one token at a time. Routers, workers, schedulers and kernels share blocks,
pages and caches. The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor
jugs. Benchmarks measure latency, throughput, goodput and concurrency under bursty arrivals.
Numbers 0 1 2 3 4 5 6 7 8 9 and punctuation . , ; : ! ? ( ) appear too.
"""


def _train_bpe(out: pathlib.Path) -> pathlib.Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    return out


@pytest.fixture(scope="session")
def corpus() -> str:
    return CORPUS


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A local HF-style directory holding a byte-level BPE tokenizer.json (like Llama 3 / Qwen)."""
    return str(_train_bpe(tmp_path_factory.mktemp("tok") / "bpe"))


@pytest.fixture(scope="session")
def builder(tokenizer_dir: str):
    from pdcluster.cluster.bench.prompts import PromptBuilder
    from pdcluster.cluster.bench.tokenizer import load_tokenizer

    return PromptBuilder(load_tokenizer(tokenizer_dir))


# -- a tiny OpenAI-compatible server -------------------------------------------------------------


@dataclass
class FakeServer:
    """Streams `num_tokens` = max_tokens chunks " w0", " w1", ...: the first after `ttft` seconds,
    each next one `itl` seconds later. Prompts containing FAIL500 get HTTP 500; FAILSTREAM get an
    error object after the first chunk. Records every request body."""

    ttft: float = 0.05
    itl: float = 0.02
    usage: bool = True
    model: str = "fake-model"
    url: str = ""
    bodies: list[dict] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.request_ids.append(request.headers.get("X-Request-Id", ""))
        chat = request.path.endswith("/chat/completions")
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        prompt_text = prompt if isinstance(prompt, str) else ""
        if "FAIL500" in prompt_text:
            return web.json_response({"error": {"message": "boom"}}, status=500)
        n = body.get("max_completion_tokens") if chat else body.get("max_tokens")
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)

            async def send(obj: object) -> None:
                await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

            await resp.write(b": keep-alive ping\n\n")
            if chat:  # servers announce the role before any token; it is not a token
                await send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            for i in range(n):
                await asyncio.sleep(self.ttft if i == 0 else self.itl)
                text = f" w{i}"
                choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
                await send({"choices": [choice]})
                if "FAILSTREAM" in prompt_text:
                    await send({"error": {"message": "worker died", "code": 500}})
                    return resp
            finish = {"index": 0, "finish_reason": "length"}
            finish |= {"delta": {}} if chat else {"text": ""}
            await send({"choices": [finish]})
            if self.usage:
                num_prompt = len(prompt_text.split()) if prompt_text else len(prompt)
                await send({"choices": [], "usage": {"prompt_tokens": num_prompt, "completion_tokens": n,
                                                     "total_tokens": num_prompt + n}})
            await resp.write(b"data: [DONE]\n\n")
            return resp
        finally:
            self.in_flight -= 1

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})


@pytest.fixture
def fake_server() -> Iterator[FakeServer]:
    """The server runs on its own event loop in a thread, so code under test may call asyncio.run."""
    server = FakeServer()
    app = web.Application()
    app.router.add_post("/v1/completions", server.completions)
    app.router.add_post("/v1/chat/completions", server.completions)
    app.router.add_get("/v1/models", server.models)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    started = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)  # port 0: the OS picks a free one
        loop.run_until_complete(site.start())
        port = runner.addresses[0][1]
        server.url = f"http://127.0.0.1:{port}"
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, name="fake-openai-server", daemon=True)
    thread.start()
    assert started.wait(10), "the fake server did not start"
    try:
        yield server
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
