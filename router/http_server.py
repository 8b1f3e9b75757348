"""The router's OpenAI-compatible HTTP frontend (aiohttp).

    POST /v1/completions, /v1/chat/completions   -> OpenAI JSON -> GenerateRequest -> the same
                                                    Preprocessor and Orchestrator as gRPC Generate
                                                    (n, best_of, echo, batched prompts: openai_fanout)
    POST /v1/responses                            -> OpenAI's Responses API on the chat path
                                                    (responses_api: the body as chat, typed events)
    POST /tokenize, /detokenize                   -> the router's tokenizer (openai_tokenize)
    GET  /v1/models, /health, /metrics

Streaming answers are Server-Sent Events (`data: {json}` ... `data: [DONE]`). The first delta is
awaited before the 200 is sent, so refusals before any output (no worker, admission, deadline)
are real HTTP errors, not a 200 followed by an error event. The handler is cancelled when the
client disconnects (handler_cancellation), which aborts the request on its workers.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from contextlib import aclosing
from typing import Any

import grpc
from aiohttp import web

from pdcluster import __version__
from pdcluster._proto import common_pb2, router_pb2, worker_pb2

from .admission import Admission
from .auth import ApiKey
from .config import RouterConfig
from .errors import RouterError, invalid, leg_failure
from .json_text import loads_bounded
from .metrics import RouterMetrics
from .openai_fanout import FanOut
from .openai_protocol import OpenAIOptions, chat_echo_text, parse_chat, parse_completions
from .openai_responses import FINISH_REASONS, ResponseBuilder, stop_reason
from .openai_tokenize import detokenize, tokenize
from .orchestrator import Orchestrator
from .peer_limits import PeerLimits
from .preprocess import PreparedRequest, Preprocessor
from .reasoning import for_request
from .registry import WorkerRegistry
from .request_state import RequestState
from .response_store import ResponseStore, list_page, output_as_input
from .responses_api import ResponsesRequest, parse_responses, rename_error
from .responses_shaper import ResponseShaper

log = logging.getLogger(__name__)

_JSON = "application/json"


def _error(err: RouterError) -> web.Response:
    return web.json_response(err.openai_body(), status=err.http_status)


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


class HttpFrontend:
    def __init__(self, config: RouterConfig, preprocessor: Preprocessor, orchestrator: Orchestrator,
                 registry: WorkerRegistry, metrics: RouterMetrics, admission: Admission | None = None,
                 peer_limits: PeerLimits | None = None) -> None:
        self.config = config
        self.peer_limits = peer_limits
        self.admission = admission or Admission(config.max_inflight, orchestrator, metrics)
        self.pre = preprocessor
        self.orch = orchestrator
        self.registry = registry
        self.metrics = metrics
        self.created = int(time.time())
        self.store = ResponseStore(config.responses_store_bytes)  # Responses kept for previous_response_id

    def app(self) -> web.Application:
        middlewares: list[Any] = [_json_errors]
        if self.config.api_key is not None:
            middlewares.append(ApiKey(self.config.api_key).http_middleware())
        middlewares.append(_identity_encoding)  # before a peer's request slot: a refusal costs nothing
        if self.peer_limits is not None:  # after the key check: strangers hold no place
            middlewares.append(self.peer_limits.middleware())
        app = web.Application(client_max_size=self.config.max_message_bytes, middlewares=middlewares)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_get("/v1/responses/{response_id}", self.stored_response)
        app.router.add_get("/v1/responses/{response_id}/input_items", self.response_input_items)
        app.router.add_delete("/v1/responses/{response_id}", self.delete_response)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)  # names hold "/": org/name
        app.router.add_get("/version", self.version)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_endpoint)
        return app

    def _with_parsers(self, opts: OpenAIOptions) -> OpenAIOptions:
        """The server's reading of answers: its --reasoning-parser and --tool-call-parser."""
        forced = opts.tools is not None and opts.tools.choice in ("required", "named")
        parser = for_request(self.config.reasoning_parser, opts.structured_field is not None, forced)
        if parser is not None:
            opts = dataclasses.replace(opts, reasoning=parser)
        if opts.tools is not None and opts.tools.choice == "auto":
            opts = dataclasses.replace(opts, tools=dataclasses.replace(opts.tools, parser=self.config.tool_call_parser))
        return opts

    def _echo_text(self, greq: router_pb2.GenerateRequest, prep: PreparedRequest) -> str:
        """echo's text: a chat's final assistant message; a prompt as sent, unless
        truncate_prompt_tokens cut it or it came as token ids: then what the model saw."""
        if greq.WhichOneof("input") == "chat":
            return chat_echo_text(greq)
        if greq.WhichOneof("input") == "prompt" and not greq.sampling_params.HasField("truncate_prompt_tokens"):
            return greq.prompt
        return self.pre.tokenizer.decode(prep.prompt_token_ids)

    # -- simple endpoints -----------------------------------------------------------------------
    def _model_card(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "pdcluster",
                "root": self.config.model, "max_model_len": self.pre.max_model_len}

    async def models(self, request: web.Request) -> web.Response:
        # Every --served-model-name is listed; without one, the model path (its basename is an alias).
        listed = self.pre.served_model_names if self.config.served_model_name else self.pre.served_model_names[:1]
        data = [self._model_card(name) for name in listed]
        return web.json_response({"object": "list", "data": data})

    async def model(self, request: web.Request) -> web.Response:
        """OpenAI's GET /v1/models/{model} (the SDK's models.retrieve): any served name or alias."""
        name = request.match_info["model"]
        if name not in self.pre.served_model_names:
            body = {"error": {"message": f"The model '{name[:200]}' does not exist.", "type": "NotFoundError",
                              "param": "model", "code": 404}}
            return web.json_response(body, status=404)
        return web.json_response(self._model_card(name))

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": __version__})

    async def health(self, request: web.Request) -> web.Response:
        n = self.registry.num_healthy
        return web.json_response({"status": "ok" if n else "no healthy worker", "healthy_workers": n,
                                  "workers": len(self.registry.handles)}, status=200 if n else 503)

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff"})

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            body = await _read_json(request, self.config.max_message_bytes, self.config.max_json_depth)
            return web.json_response(await tokenize(self.pre, body))
        except RouterError as e:
            return _error(e)

    async def detokenize(self, request: web.Request) -> web.Response:
        try:
            body = await _read_json(request, self.config.max_message_bytes, self.config.max_json_depth)
            return web.json_response(detokenize(self.pre, body))
        except RouterError as e:
            return _error(e)

    def error(self, err: RouterError, opts: OpenAIOptions | None = None) -> web.Response:
        """An error answer; a worker's refusal of the structured-output spec (it compiles it) is
        reported under the field the client used."""
        return _error(self.client_error(err, opts))

    @staticmethod
    def client_error(err: RouterError, opts: OpenAIOptions | None = None) -> RouterError:
        return _client_field(err, opts)

    # -- generation -----------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            with self.admission.preparing("http"):
                body = await _read_json(request, self.config.max_message_bytes, self.config.max_json_depth)
                if chat:
                    greq, opts = parse_chat(body, self.pre.model_name, self.pre.image_limits)
                    opts = self._with_parsers(opts)
                    greqs = [greq]
                else:
                    greqs, opts = parse_completions(body, self.pre.model_name)
                header_id = request.headers.get("X-Request-Id", "") or greqs[0].request_id
                preps = []
                for greq in greqs:  # every prompt is valid before any runs
                    greq.request_id = header_id or preps[0].request_id if preps else header_id
                    preps.append(await self.pre.prepare(greq, self.config.request_timeout_s,
                                                        chat_max_tokens_default=chat))
        except RouterError as e:
            self.orch.count_refused("http", e)
            return _error(e)
        if len(preps) > 1 or opts.best_of > 1 or opts.echo:
            # The prompt as sent, unless truncate_prompt_tokens cut it: then what the model saw.
            echoes = [self._echo_text(g, p) for g, p in zip(greqs, preps)] if opts.echo else []
            return await FanOut(self, opts, preps, echoes).respond(request)
        prep = preps[0]
        try:
            state = self.orch.open_request(prep, "http")
        except RouterError as e:
            return _error(e)
        builder = ResponseBuilder(prep.request_id, opts, len(prep.prompt_token_ids), self.pre.token_text,
                                  prompt_token_ids=prep.prompt_token_ids)
        async with aclosing(self.orch.stream(state)) as deltas:
            try:
                first = await anext(deltas)
            except RouterError as e:
                return self.error(e, opts)
            except StopAsyncIteration:
                return _error(RouterError(grpc.StatusCode.INTERNAL, "no response from the worker"))
            if opts.stream:
                return await self._stream(request, state, builder, opts, first, deltas)
            return await self._collect(builder, opts, first, deltas)

    async def _collect(self, builder: ResponseBuilder, opts: OpenAIOptions, first: worker_pb2.WorkerGenerateResponse,
                       deltas: Any) -> web.Response:
        texts: list[str] = []
        logprobs: list[Any] = []

        def take(delta: worker_pb2.WorkerGenerateResponse) -> None:
            builder.account(delta)
            texts.append(delta.text)
            logprobs.extend(delta.logprobs)

        last = await _through_final(first, deltas, take)
        if last.finish_reason == common_pb2.FINISH_REASON_ERROR:
            return _error(_failed(last, opts))
        body = builder.full("".join(texts), last.finish_reason, logprobs, stop_reason(last))
        return web.Response(body=_dumps(body), content_type=_JSON)

    async def _stream(self, request: web.Request, state: RequestState, builder: ResponseBuilder,
                      opts: OpenAIOptions, first: worker_pb2.WorkerGenerateResponse, deltas: Any) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Request-Id": state.request_id})
        await resp.prepare(request)
        try:
            if opts.chat:
                await _event(resp, builder.role_chunk())
            delta = first
            while True:
                builder.account(delta)
                if delta.finished and delta.finish_reason == common_pb2.FINISH_REASON_ERROR:
                    await _event(resp, _failed(delta, opts).openai_body())
                    break
                chunk = builder.delta_chunk(delta)
                if chunk is not None:  # None: nothing to send yet (a chat with tools holds what may be a call)
                    await _event(resp, chunk)
                if delta.finished:
                    if opts.include_usage:
                        await _event(resp, builder.usage_chunk())
                    break
                delta = await anext(deltas)
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, StopAsyncIteration) as e:
            # Client gone (or a stream cut short): leaving the `aclosing` block aborts the request.
            log.debug("stream %s ended early: %r", state.request_id, e)
            return resp
        await resp.write_eof()
        return resp


    # -- the Responses API ------------------------------------------------------------------------
    async def responses(self, request: web.Request) -> web.StreamResponse:
        try:
            with self.admission.preparing("http"):
                body = await _read_json(request, self.config.max_message_bytes, self.config.max_json_depth)
                history = self._stored_history(body)
                greq, opts, info = parse_responses(body, self.pre.model_name, self.pre.image_limits,
                                                   self.store.enabled, history)
                opts = self._with_parsers(opts)
                greq.request_id = request.headers.get("X-Request-Id", "")
                try:
                    prep = await self.pre.prepare(greq, self.config.request_timeout_s, chat_max_tokens_default=True)
                except RouterError as e:
                    raise rename_error(e, info.message_of_item) from None
        except RouterError as e:
            self.orch.count_refused("http", e)
            return _error(e)
        try:
            state = self.orch.open_request(prep, "http")
        except RouterError as e:
            return _error(e)
        shaper = ResponseShaper(prep.request_id, opts, info, len(prep.prompt_token_ids), self.pre.token_text)
        async with aclosing(self.orch.stream(state)) as deltas:
            try:
                delta = await anext(deltas)
            except RouterError as e:
                return _error(rename_error(_client_field(e, opts)))
            except StopAsyncIteration:
                return _error(RouterError(grpc.StatusCode.INTERNAL, "no response from the worker"))
            if not opts.stream:
                last = await _through_final(delta, deltas, shaper.add)
                if last.finish_reason == common_pb2.FINISH_REASON_ERROR:
                    return _error(rename_error(_failed(last, opts)))
                body = shaper.full(last.finish_reason)
                self._keep(body, info)
                return web.Response(body=_dumps(body), content_type=_JSON)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Request-Id": state.request_id})
            await resp.prepare(request)
            try:
                for ev in shaper.opening():
                    await _typed_event(resp, ev)
                while True:
                    logprobs = shaper.add(delta)
                    if delta.text and not shaper.held:
                        await _typed_event(resp, shaper.text_delta(delta.text, logprobs))
                    if delta.finished:
                        events = shaper.closing(delta.finish_reason, delta.error_message or "generation failed")
                        self._keep(events[-1]["response"], info)  # before it is sent: "store" says if it was
                        for ev in events:
                            await _typed_event(resp, ev)
                        break
                    delta = await anext(deltas)
            except (ConnectionResetError, StopAsyncIteration) as e:
                log.debug("stream %s ended early: %r", state.request_id, e)  # leaving aclosing aborts it
                return resp
            await resp.write_eof()
            return resp

    def _stored_history(self, body: Any) -> list[dict[str, Any]]:
        """The conversation previous_response_id names (RouterError naming it when it is not kept)."""
        prev = body.get("previous_response_id") if isinstance(body, dict) else None
        if prev is None or not self.store.enabled:
            return []  # parse_responses refuses it by name when the store is off
        if not isinstance(prev, str) or len(prev) > 256:
            raise invalid("previous_response_id", "must be a response id string")
        entry = self.store.get(prev)
        if entry is None:
            raise invalid("previous_response_id", f"no stored response has id {prev[:80]!r} (responses are kept "
                          "in the router's memory, the least recently used dropped first, and forgotten on restart)")
        return list(entry.conversation)

    def _keep(self, response: dict[str, Any], info: ResponsesRequest) -> None:
        """Store a finished answer the request asked to keep; a failed one, or one too large for the
        store, is not kept, and the Response object says so ("store": false)."""
        if not response.get("store"):
            return
        if response["status"] not in ("completed", "incomplete") or not self.store.put(
                response, [*info.conversation, *output_as_input(response["output"])], len(info.conversation)):
            response["store"] = False

    async def stored_response(self, request: web.Request) -> web.Response:
        """GET /v1/responses/{id}: a stored Response object."""
        entry = self.store.get(request.match_info["response_id"])
        if entry is None:
            return _error(RouterError(grpc.StatusCode.NOT_FOUND, "no stored response has this id", "response_id"))
        return web.Response(body=_dumps(entry.response), content_type=_JSON)

    async def response_input_items(self, request: web.Request) -> web.Response:
        """GET /v1/responses/{id}/input_items: the items a stored answer was generated from
        (earlier turns, then its request's input), one page of them (response_store.list_page)."""
        entry = self.store.get(request.match_info["response_id"])
        if entry is None:
            return _error(RouterError(grpc.StatusCode.NOT_FOUND, "no stored response has this id", "response_id"))
        try:
            page = list_page(entry.input_items(), request.query)
        except RouterError as e:
            return _error(e)
        return web.Response(body=_dumps(page), content_type=_JSON)

    async def delete_response(self, request: web.Request) -> web.Response:
        """DELETE /v1/responses/{id}: forget it."""
        response_id = request.match_info["response_id"]
        if not self.store.delete(response_id):
            return _error(RouterError(grpc.StatusCode.NOT_FOUND, "no stored response has this id", "response_id"))
        return web.json_response({"id": response_id, "object": "response", "deleted": True})


async def _through_final(first: worker_pb2.WorkerGenerateResponse, deltas: Any,
                         take: Any) -> worker_pb2.WorkerGenerateResponse:
    """Hand `take` every delta from `first` to the final one (or the last the stream had); return it."""
    delta = first
    while True:
        take(delta)
        if delta.finished:
            return delta
        try:
            delta = await anext(deltas)
        except StopAsyncIteration:
            return delta


def _failed(last: worker_pb2.WorkerGenerateResponse, opts: OpenAIOptions | None = None) -> RouterError:
    return _client_field(leg_failure(last.error_message, last.error_field), opts)


def _client_field(err: RouterError, opts: OpenAIOptions | None) -> RouterError:
    """A worker's refusal of the structured-output spec (it compiles it) under the field the client used."""
    if (opts is not None and opts.structured_field and err.field in (None, "structured_outputs")
            and err.code == grpc.StatusCode.INVALID_ARGUMENT and "structured_outputs" in err.message):
        return RouterError(err.code, err.message, opts.structured_field)
    return err


async def _typed_event(resp: web.StreamResponse, event: dict[str, Any]) -> None:
    """A Responses API event: its type on an `event:` line, then the object."""
    await resp.write(b"event: " + event["type"].encode() + b"\ndata: " + _dumps(event) + b"\n\n")


async def _event(resp: web.StreamResponse, obj: Any) -> None:
    await resp.write(b"data: " + _dumps(obj) + b"\n\n")


async def _read_json(request: web.Request, limit: int, max_depth: int) -> Any:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise RouterError(grpc.StatusCode.INVALID_ARGUMENT,
                          f"request body exceeds the limit of {limit} bytes",
                          "body", http_status=413) from None
    body = loads_bounded(raw, max_depth, "body", "the request body")
    # JSON may escape half a surrogate pair ("\ud800"): a str no tokenizer, protobuf field or
    # UTF-8 writer takes. Only such an escape can make one, so most bodies skip the walk.
    if (b"\\ud" in raw or b"\\uD" in raw) and isinstance(body, dict):
        for key, value in body.items():
            if _has_lone_surrogate(key) or _has_lone_surrogate(value):
                raise invalid(str(key).encode("utf-8", "replace").decode(),
                              "contains an unpaired UTF-16 surrogate escape (\\ud800-\\udfff): not valid text")
    return body


def _has_lone_surrogate(obj: Any) -> bool:
    """Whether any string in parsed JSON (keys too) holds a lone surrogate; iterative."""
    stack = [obj]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


# Build the app's runner with these: aiohttp would otherwise inflate a gzip/deflate/br body on the
# event loop as it arrives, before any handler or size limit can refuse it (a 16 MB gzip of zeros
# held the router's loop for ~4 s). Bodies are taken as sent; _identity_encoding refuses the rest.
RUNNER_ARGS: dict[str, Any] = {"handler_cancellation": True, "access_log": None, "auto_decompress": False}


@web.middleware
async def _identity_encoding(request: web.Request, handler: Any) -> web.StreamResponse:
    """A compressed request body is refused by name (415, RFC 7694's Accept-Encoding: identity)."""
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        body = {"error": {"message": f"Content-Encoding {encoding[:40]!r} is not accepted: send the body uncompressed",
                          "type": "UnsupportedMediaTypeError", "param": "Content-Encoding", "code": 415}}
        return web.json_response(body, status=415, headers={"Accept-Encoding": "identity"})
    return await handler(request)


@web.middleware
async def _json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """aiohttp's own errors (unknown path, wrong method, ...) in the OpenAI error shape."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        body = {"error": {"message": e.reason, "type": type(e).__name__, "param": None, "code": e.status}}
        return web.json_response(body, status=e.status, headers={k: v for k, v in e.headers.items()
                                                                 if k.lower() == "allow"})


__all__ = ["FINISH_REASONS", "RUNNER_ARGS", "HttpFrontend"]
