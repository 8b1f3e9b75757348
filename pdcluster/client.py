"""Python client of the pdcluster router (pdcluster.v1.Router, proto/pdcluster/v1/router.proto).

    from pdcluster.client import Client
    from pdcluster import SamplingParams

    with Client("127.0.0.1:8000") as client:
        result = client.generate("Hello", SamplingParams(max_tokens=32, temperature=0))
        for delta in client.generate_stream([1, 2, 3], SamplingParams(max_tokens=8)):
            print(delta.text, end="")

`AsyncClient` has the same methods as coroutines / async iterators. The prompt is text, token
ids, or chat messages ([{"role": "user", "content": ...}], or text with chat=True). Every gRPC
error becomes a `ClientError(code, message)`. Leaving a stream early cancels the call, which
aborts the request on every worker. Imports no torch (a client must start fast anywhere).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from pdcluster._proto import common_pb2, router_pb2, router_pb2_grpc
from pdcluster.proto_convert import FINISH_REASON_FROM_PROTO, ROLE_TO_PROTO, sampling_params_to_proto
from pdcluster.sampling_params import SamplingParams
from pdcluster.worker.options import DEFAULT_MAX_MESSAGE_BYTES, channel_options
from pdcluster.worker.tls import TLSConfig, channel_credentials, channel_tls_options

Prompt = str | Sequence[int] | Sequence[Mapping[str, str]]


class ClientError(Exception):
    """A failed call: `code` is the grpc.StatusCode, `message` the server's explanation."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class Delta:
    """One streamed response: what is new since the previous one."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    usage: Usage | None = None  # on the final delta
    error: str | None = None
    # With error: the request field at fault when the request itself could not go on (its grammar,
    # allowed_token_ids or min_tokens left no token to sample); None when the cluster failed it.
    error_field: str | None = None
    logprobs: list[Any] = field(default_factory=list)  # proto SampleLogprobs, one per token
    token_arrival_times: list[float] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    first_token_time: float = 0.0
    route: Any = None  # router RouteInfo (on the final delta)
    # SamplingParams.prompt_logprobs: proto SampleLogprobs per prompt token after the first (first delta)
    prompt_logprobs: list[Any] = field(default_factory=list)


@dataclass
class CompletionResult(Delta):
    """The whole result of one request (generate()): all deltas concatenated."""


def delta_from_proto(msg: Any) -> Delta:
    """Works for the router's GenerateResponse and, where the fields overlap, the worker's."""
    stop_field = msg.WhichOneof("stop_reason")
    has = msg.DESCRIPTOR.fields_by_name
    return Delta(
        request_id=msg.request_id,
        token_ids=list(msg.token_ids),
        text=msg.text,
        finished=msg.finished,
        finish_reason=FINISH_REASON_FROM_PROTO.get(msg.finish_reason),
        stop_reason=getattr(msg, stop_field) if stop_field else None,
        usage=Usage(msg.usage.prompt_tokens, msg.usage.completion_tokens, msg.usage.cached_tokens)
        if msg.HasField("usage") else None,
        error=msg.error_message or None,
        error_field=msg.error_field or None,
        logprobs=list(msg.logprobs),
        token_arrival_times=list(msg.token_arrival_times),
        prompt_token_ids=list(msg.prompt_token_ids) if "prompt_token_ids" in has else [],
        first_token_time=msg.first_token_time if "first_token_time" in has else 0.0,
        route=msg.route if "route" in has and msg.HasField("route") else None,
        prompt_logprobs=list(msg.prompt_logprobs),
    )


def merge_deltas(deltas: Sequence[Delta]) -> CompletionResult:
    result = CompletionResult(request_id="", token_ids=[], text="")
    texts = []
    for d in deltas:
        result.request_id = d.request_id or result.request_id
        result.token_ids.extend(d.token_ids)
        texts.append(d.text)
        result.logprobs.extend(d.logprobs)
        result.token_arrival_times.extend(d.token_arrival_times)
        result.prompt_token_ids = result.prompt_token_ids or d.prompt_token_ids
        result.prompt_logprobs = result.prompt_logprobs or d.prompt_logprobs
        if d.finished:
            result.finished, result.finish_reason, result.stop_reason = True, d.finish_reason, d.stop_reason
            result.usage, result.error, result.error_field, result.route = d.usage, d.error, d.error_field, d.route
            result.first_token_time = d.first_token_time
    result.text = "".join(texts)
    return result


def build_request(prompt: Prompt, sampling_params: SamplingParams | None, *, request_id: str | None = None,
                  chat: bool = False, stream: bool = True, model: str = "",
                  return_prompt_token_ids: bool = False) -> router_pb2.GenerateRequest:
    req = router_pb2.GenerateRequest(request_id=request_id or "", sampling_params=sampling_params_to_proto(sampling_params),
                                     stream=stream, model=model, return_prompt_token_ids=return_prompt_token_ids)
    if isinstance(prompt, str):
        if chat:
            req.chat.messages.add(role="user", content=prompt)
            req.chat.add_generation_prompt = True
        else:
            req.prompt = prompt
    elif isinstance(prompt, Sequence) and prompt and all(isinstance(m, Mapping) for m in prompt):
        for m in prompt:
            msg = req.chat.messages.add(role=str(m.get("role", "user")), content=str(m.get("content", "")))
            if m.get("name"):
                msg.name = str(m["name"])
        req.chat.add_generation_prompt = True
    elif isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
        ids = list(prompt)
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 2**32 for t in ids):
            raise ValueError("prompt: token ids must be integers in [0, 2**32)")
        req.prompt_token_ids.ids.extend(ids)
        if not ids:  # an empty TokenIds still selects the oneof: the router answers INVALID_ARGUMENT
            req.prompt_token_ids.SetInParent()
    else:
        raise ValueError(f"prompt must be text, token ids or chat messages, got {type(prompt).__name__}")
    return req


def _client_error(e: grpc.RpcError) -> ClientError:
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = e.details() if hasattr(e, "details") else str(e)
    return ClientError(code or grpc.StatusCode.UNKNOWN, details or "")


def _auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    """The router's `--api-key`, sent with every call (plaintext channels cannot carry call
    credentials, so it is plain metadata: use TLS beyond loopback)."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else None


def _channel_args(address: str, tls: TLSConfig | None, max_message_bytes: int) -> dict[str, Any]:
    return {"target": address, "options": channel_options(max_message_bytes) + channel_tls_options(tls)}


class Client:
    """Synchronous router client; thread-safe; a context manager that closes its channel."""

    def __init__(self, address: str, timeout: float | None = None, tls: TLSConfig | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, api_key: str | None = None) -> None:
        self.address = address
        self._md = _auth_metadata(api_key)
        self.timeout = timeout  # default per-call deadline in seconds (None: no deadline)
        kw = _channel_args(address, tls, max_message_bytes)
        self._channel = grpc.secure_channel(credentials=channel_credentials(tls), **kw) if tls is not None \
            else grpc.insecure_channel(**kw)
        self._stub = router_pb2_grpc.RouterStub(self._channel)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def wait_for_ready(self, timeout: float = 10.0) -> None:
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise ClientError(grpc.StatusCode.UNAVAILABLE, f"{self.address} not reachable in {timeout}s") from None

    def generate_stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None, *,
                        request_id: str | None = None, deadline_s: float | None = None, chat: bool = False,
                        model: str = "", return_prompt_token_ids: bool = False) -> Iterator[Delta]:
        req = build_request(prompt, sampling_params, request_id=request_id, chat=chat, model=model,
                            return_prompt_token_ids=return_prompt_token_ids)
        call = self._stub.Generate(req, timeout=deadline_s if deadline_s is not None else self.timeout,
                                 metadata=self._md)
        try:
            for msg in call:
                yield delta_from_proto(msg)
        except grpc.RpcError as e:
            raise _client_error(e) from None
        finally:
            call.cancel()  # no-op when the stream ended; aborts the request when left early

    def generate(self, prompt: Prompt, sampling_params: SamplingParams | None = None, *,
                 request_id: str | None = None, deadline_s: float | None = None, chat: bool = False,
                 model: str = "", return_prompt_token_ids: bool = False) -> CompletionResult:
        req = build_request(prompt, sampling_params, request_id=request_id, chat=chat, stream=False, model=model,
                            return_prompt_token_ids=return_prompt_token_ids)
        try:
            msgs = list(self._stub.Generate(req, timeout=deadline_s if deadline_s is not None else self.timeout,
                                 metadata=self._md))
        except grpc.RpcError as e:
            raise _client_error(e) from None
        return merge_deltas([delta_from_proto(m) for m in msgs])

    def abort(self, request_ids: str | Sequence[str]) -> list[str]:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        try:
            resp = self._stub.Abort(common_pb2.AbortRequest(request_ids=ids), timeout=self.timeout,
                                                metadata=self._md)
        except grpc.RpcError as e:
            raise _client_error(e) from None
        return list(resp.aborted_request_ids)

    def list_workers(self, role: str | None = None) -> list[router_pb2.WorkerEntry]:
        req = router_pb2.ListWorkersRequest(role=ROLE_TO_PROTO[role] if role else 0)
        try:
            return list(self._stub.ListWorkers(req, timeout=self.timeout, metadata=self._md).workers)
        except grpc.RpcError as e:
            raise _client_error(e) from None


class AsyncClient:
    """asyncio router client (grpc.aio); create and use it inside one event loop."""

    def __init__(self, address: str, timeout: float | None = None, tls: TLSConfig | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, api_key: str | None = None) -> None:
        self.address = address
        self._md = _auth_metadata(api_key)
        self.timeout = timeout
        kw = _channel_args(address, tls, max_message_bytes)
        self._channel = grpc.aio.secure_channel(credentials=channel_credentials(tls), **kw) if tls is not None \
            else grpc.aio.insecure_channel(**kw)
        self._stub = router_pb2_grpc.RouterStub(self._channel)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close(grace=None)

    async def generate_stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None, *,
                              request_id: str | None = None, deadline_s: float | None = None, chat: bool = False,
                              model: str = "", return_prompt_token_ids: bool = False) -> AsyncIterator[Delta]:
        req = build_request(prompt, sampling_params, request_id=request_id, chat=chat, model=model,
                            return_prompt_token_ids=return_prompt_token_ids)
        call = self._stub.Generate(req, timeout=deadline_s if deadline_s is not None else self.timeout,
                                 metadata=self._md)
        try:
            async for msg in call:
                yield delta_from_proto(msg)
        except grpc.RpcError as e:
            raise _client_error(e) from None
        finally:
            call.cancel()

    async def generate(self, prompt: Prompt, sampling_params: SamplingParams | None = None, *,
                       request_id: str | None = None, deadline_s: float | None = None, chat: bool = False,
                       model: str = "", return_prompt_token_ids: bool = False) -> CompletionResult:
        req = build_request(prompt, sampling_params, request_id=request_id, chat=chat, stream=False, model=model,
                            return_prompt_token_ids=return_prompt_token_ids)
        call = self._stub.Generate(req, timeout=deadline_s if deadline_s is not None else self.timeout,
                                 metadata=self._md)
        try:
            msgs = [m async for m in call]
        except grpc.RpcError as e:
            raise _client_error(e) from None
        return merge_deltas([delta_from_proto(m) for m in msgs])

    async def abort(self, request_ids: str | Sequence[str]) -> list[str]:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        try:
            resp = await self._stub.Abort(common_pb2.AbortRequest(request_ids=ids), timeout=self.timeout,
                                                metadata=self._md)
        except grpc.RpcError as e:
            raise _client_error(e) from None
        return list(resp.aborted_request_ids)

    async def list_workers(self, role: str | None = None) -> list[router_pb2.WorkerEntry]:
        req = router_pb2.ListWorkersRequest(role=ROLE_TO_PROTO[role] if role else 0)
        try:
            return list((await self._stub.ListWorkers(req, timeout=self.timeout, metadata=self._md)).workers)
        except grpc.RpcError as e:
            raise _client_error(e) from None


__all__ = ["AsyncClient", "Client", "ClientError", "CompletionResult", "Delta", "Usage", "build_request",
           "delta_from_proto"]
