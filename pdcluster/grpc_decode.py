"""Servicers whose undecodable requests are refused as INVALID_ARGUMENT, naming the message.

grpc calls a method's request deserializer (the generated `Message.FromString`) before the
servicer runs; a DecodeError there (bytes that are no such message: a truncated or corrupt frame,
a string field holding invalid UTF-8) reaches the client as UNKNOWN "Unexpected DecodeError".
`add_servicer(add_fn, servicer, server)` registers exactly what the generated
`add_XServicer_to_server` would, with each unary-request method's deserializer wrapped: a
message that does not decode becomes an `Undecodable` value, which the wrapped behaviour answers
with INVALID_ARGUMENT "request: not a valid <type> (<why>)". Streaming-request methods are left
as generated (their messages are decoded one by one inside the call).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError


@dataclass(frozen=True)
class Undecodable:
    type_name: str
    error: str


class _Recorder:
    """Stands in for the server while a generated add function registers its handlers."""

    def __init__(self) -> None:
        self.service: str | None = None
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass  # the same handlers come through add_registered_method_handlers

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.service, self.handlers = service, dict(handlers)


def add_servicer(add_fn: Callable[[Any, Any], None], servicer: Any, server: Any) -> None:
    recorder = _Recorder()
    add_fn(servicer, recorder)
    if recorder.service is None:
        raise RuntimeError(f"{add_fn.__name__} registered no service (a grpcio-tools stub older than this code?)")
    handlers = {name: _checked(h) for name, h in recorder.handlers.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(recorder.service, handlers),))
    server.add_registered_method_handlers(recorder.service, handlers)


def _checked(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    if handler.request_streaming or handler.request_deserializer is None:
        return handler
    decode = handler.request_deserializer
    type_name = getattr(getattr(decode, "__self__", None), "DESCRIPTOR", None)
    type_name = type_name.full_name if type_name is not None else "request message"

    def safe_decode(data: bytes) -> Any:
        try:
            return decode(data)
        except DecodeError as e:
            return Undecodable(type_name, str(e))

    field = "unary_stream" if handler.response_streaming else "unary_unary"
    behavior = getattr(handler, field)
    return handler._replace(request_deserializer=safe_decode, **{field: _refusing(behavior)})


def _refusing(behavior: Callable[..., Any]) -> Callable[..., Any]:
    """behavior, answering an Undecodable request with INVALID_ARGUMENT; the same kind of
    callable (coroutine, async generator, or plain function for a sync grpc.server)."""
    def why(request: Undecodable) -> str:
        return f"request: not a valid {request.type_name} ({request.error})"

    if inspect.isasyncgenfunction(behavior):
        async def stream(request: Any, context: Any) -> Any:
            if isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why(request))
            async for item in behavior(request, context):
                yield item
        return stream
    if inspect.iscoroutinefunction(behavior):
        async def call(request: Any, context: Any) -> Any:
            if isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why(request))
            return await behavior(request, context)
        return call

    def sync_call(request: Any, context: Any) -> Any:
        if isinstance(request, Undecodable):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, why(request))  # raises
        return behavior(request, context)
    return sync_call


__all__ = ["Undecodable", "add_servicer"]
