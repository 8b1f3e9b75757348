"""n > 1, best_of, echo and batched prompts: one OpenAI request as several generations.

Each prompt is sampled best_of times (best_of = n unless asked); every generation is an ordinary
router request (its own id `<id>-<k>`, admission, routing, retries, cancellation). A prompt's
first generation starts alone; its siblings start once it has produced its first token, so the
prompt's KV blocks are computed once and are in the worker's prefix cache (and, with the
prefix_aware policy, in the router's index) when the siblings arrive: they compute only the last,
partial block. Seeded requests give sibling j the seed + j, so the choices differ.

best_of > n keeps the n generations with the highest cumulative logprob (sampled-token logprobs
are requested for that; they are left out of the answer unless the client asked for logprobs).
Streams interleave the choices' chunks as they come, each with its index; best_of > n cannot
stream. Answers are built by openai_responses.ResponseBuilder, one per generation.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
from aiohttp import web

from pdcluster._proto import common_pb2, worker_pb2
from pdcluster.sampling_params import sibling_seed

from .errors import RouterError, leg_failure
from .openai_protocol import OpenAIOptions
from .openai_responses import ResponseBuilder, merged_usage, stop_reason
from .preprocess import PreparedRequest

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Gen:
    prompt: int
    sibling: int
    prep: PreparedRequest
    builder: ResponseBuilder
    texts: list[str] = field(default_factory=list)
    logprobs: list[common_pb2.SampleLogprobs] = field(default_factory=list)
    last: worker_pb2.WorkerGenerateResponse | None = None

    def cumulative_logprob(self) -> float:
        return sum(lp.sampled.logprob for lp in self.logprobs)


_DONE = object()


class FanOut:
    """Runs the generations of one request and writes its answer (whole or streamed)."""

    def __init__(self, front: Any, opts: OpenAIOptions, preps: list[PreparedRequest], echo_texts: list[str]) -> None:
        self.front = front
        self.opts = opts
        base = preps[0].request_id
        self.gens: list[_Gen] = []
        for p, prep in enumerate(preps):
            for j in range(opts.best_of):
                sub = _sibling(prep, f"{base}-{len(self.gens)}", j, force_logprobs=opts.best_of > opts.n)
                builder = ResponseBuilder(base, opts, len(prep.prompt_token_ids), front.pre.token_text,
                                          index=p * opts.n + j, echo=echo_texts[p] if opts.echo else "",
                                          first_prompt_token=prep.prompt_token_ids[0],
                                          prompt_token_ids=prep.prompt_token_ids)
                self.gens.append(_Gen(p, j, sub, builder))
        self.head = self.gens[0].builder
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []

    async def respond(self, request: web.Request) -> web.StreamResponse:
        try:
            for p in range(len(self.gens) // self.opts.best_of):
                group = self.gens[p * self.opts.best_of:(p + 1) * self.opts.best_of]
                self._tasks.append(asyncio.create_task(self._group(group)))
            if self.opts.stream:
                return await self._stream(request)
            return await self._collect()
        finally:
            for t in self._tasks:
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- producers ------------------------------------------------------------------------------
    async def _group(self, group: list[_Gen]) -> None:
        started = asyncio.Event()
        lead = asyncio.create_task(self._run(group[0], started))
        await started.wait()  # the prompt is in the worker's cache (or the lead failed)
        rest = [asyncio.create_task(self._run(g)) for g in group[1:]]
        try:
            await asyncio.gather(lead, *rest)
        finally:
            for t in (lead, *rest):
                t.cancel()

    async def _run(self, g: _Gen, started: asyncio.Event | None = None) -> None:
        orch = self.front.orch
        try:
            state = orch.open_request(g.prep, "http")
            async with aclosing(orch.stream(state)) as deltas:
                async for delta in deltas:
                    if started is not None:
                        started.set()
                    await self._queue.put((g, delta))
                    if delta.finished:
                        break
        except RouterError as e:
            await self._queue.put((g, e))
        finally:
            if started is not None:
                started.set()
            self._queue.put_nowait((g, _DONE))

    # -- consumers ------------------------------------------------------------------------------
    async def _collect(self) -> web.Response:
        remaining = len(self.gens)
        while remaining:
            g, item = await self._queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, RouterError):
                return self.front.error(item, self.opts)
            else:
                g.builder.account(item)
                g.texts.append(item.text)
                g.logprobs.extend(item.logprobs)
                g.last = item
        choices = []
        for p in range(len(self.gens) // self.opts.best_of):
            group = self.gens[p * self.opts.best_of:(p + 1) * self.opts.best_of]
            if any(g.last is None for g in group):
                return self.front.error(RouterError(grpc.StatusCode.INTERNAL, "no response from the worker"), self.opts)
            failed = next((g.last for g in group if g.last.finish_reason == common_pb2.FINISH_REASON_ERROR), None)
            if failed is not None:
                return self.front.error(leg_failure(failed.error_message, failed.error_field), self.opts)
            if self.opts.best_of > self.opts.n:
                group = sorted(group, key=lambda g: g.cumulative_logprob(), reverse=True)[: self.opts.n]
            for k, g in enumerate(group):
                g.builder.index = p * self.opts.n + k
                assert g.last is not None
                choices.append(g.builder.choice("".join(g.texts), g.last.finish_reason, g.logprobs,
                                                stop_reason(g.last)))
        body = self.head.response(choices, self._usage())
        return web.Response(body=_dumps(body), content_type="application/json")

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        remaining = len(self.gens)
        first = await self._queue.get()  # refusals before any output are real HTTP errors
        while first[1] is _DONE:
            remaining -= 1
            if not remaining:
                return self.front.error(RouterError(grpc.StatusCode.INTERNAL, "no response from the worker"), self.opts)
            first = await self._queue.get()
        if isinstance(first[1], RouterError):
            return self.front.error(first[1], self.opts)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Request-Id": self.gens[0].prep.request_id})
        await resp.prepare(request)
        try:
            if self.opts.chat:
                for g in self.gens:
                    await _event(resp, g.builder.role_chunk())
            item: Any = first
            while True:
                g, delta = item
                if delta is _DONE:
                    remaining -= 1
                    if not remaining:
                        break
                elif isinstance(delta, RouterError) or (
                        delta.finished and delta.finish_reason == common_pb2.FINISH_REASON_ERROR):
                    err = delta if isinstance(delta, RouterError) else leg_failure(delta.error_message,
                                                                                   delta.error_field)
                    await _event(resp, self.front.client_error(err, self.opts).openai_body())
                    break
                else:
                    g.builder.account(delta)
                    chunk = g.builder.delta_chunk(delta)
                    if chunk is not None:
                        await _event(resp, chunk)
                item = await self._queue.get()
            if remaining == 0 and self.opts.include_usage:
                await _event(resp, self.head.usage_chunk(self._usage()))
            await resp.write(b"data: [DONE]\n\n")
        except ConnectionResetError as e:
            log.debug("stream %s ended early: %r", self.gens[0].prep.request_id, e)
            return resp
        await resp.write_eof()
        return resp

    def _usage(self) -> dict[str, Any]:
        leads = [g.builder for g in self.gens if g.sibling == 0]
        return merged_usage([g.builder for g in self.gens], leads)


def _sibling(prep: PreparedRequest, request_id: str, j: int, *, force_logprobs: bool) -> PreparedRequest:
    sp = common_pb2.SamplingParams()
    sp.CopyFrom(prep.sampling_params)
    if j and sp.HasField("seed"):
        sp.seed = sibling_seed(sp.seed, j)
    if force_logprobs and not sp.HasField("logprobs"):
        sp.logprobs = 0  # the sampled token's logprob: best_of ranks by their sum
    return replace(prep, request_id=request_id, sampling_params=sp)


async def _event(resp: web.StreamResponse, obj: Any) -> None:
    await resp.write(b"data: " + _dumps(obj) + b"\n\n")


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
