"""Authorization by role on gRPC servers that run mutual TLS (pki.py identities).

The peer's role and name come from its verified certificate (the spiffe://pdcluster/ROLE/NAME
SAN, exposed by gRPC as `peer_spiffe_id` in the call's auth context), never from request data.
A `RolePolicy` maps full method names to the roles allowed to call them; methods it does not
name are open to any peer that completed the mTLS handshake (health, stats). A refused call ends
PERMISSION_DENIED before the handler runs; each refusal is counted by method and role and
logged with the peer's address and identity. Only the methods a policy names are wrapped: the
others (health, info) need no more than the handshake, which already proved a CA-signed peer.

    policy = RolePolicy({"/pdcluster.v1.Worker/Generate": {"router"}})
    server = grpc.aio.server(interceptors=[AioRoleInterceptor(policy)])   # grpc.aio
    server = grpc.server(pool, interceptors=[RoleInterceptor(policy)])    # sync grpc

The handler wrappers replace only the behaviour; serializers stay the method's own.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import grpc

from .pki import parse_spiffe

log = logging.getLogger(__name__)


def peer_identity(context: Any) -> tuple[str, str] | None:
    """(role, name) of the caller's verified certificate, or None (plaintext, or no identity)."""
    try:
        values = context.auth_context().get("peer_spiffe_id") or []
    except Exception:  # an auth context that cannot be read names nobody
        return None
    for value in values:
        parsed = parse_spiffe(value.decode(errors="replace") if isinstance(value, bytes) else str(value))
        if parsed is not None:
            return parsed
    return None


class RolePolicy:
    def __init__(self, allowed: Mapping[str, Iterable[str]]) -> None:
        self.allowed = {method: frozenset(roles) for method, roles in allowed.items()}
        self.refusals: Counter[str] = Counter()
        self._lock = threading.Lock()

    def check(self, method: str, context: Any) -> str | None:
        """None if the caller may call `method`, else why not (also counted and logged)."""
        roles = self.allowed.get(method)
        who = peer_identity(context)
        if roles is None:
            return None
        if who is None:
            reason = "no verified identity"
        elif who[0] in roles:
            return None
        else:
            reason = f"role {who[0]!r} may not call it"
        label = f"{method}:{who[0] if who else 'none'}"
        with self._lock:
            self.refusals[label] += 1
        log.warning("refused %s from %s (%s): %s", method, _peer(context),
                    f"{who[0]}/{who[1]}" if who else "no identity", reason)
        return reason

    def total_refusals(self) -> int:
        with self._lock:
            return sum(self.refusals.values())


def _peer(context: Any) -> str:
    try:
        return str(context.peer())
    except Exception:
        return "?"


def _wrap_sync(handler: grpc.RpcMethodHandler, method: str, policy: RolePolicy) -> grpc.RpcMethodHandler:
    def guard(behavior: Callable[..., Any]) -> Callable[..., Any]:
        def checked(request: Any, context: grpc.ServicerContext) -> Any:
            reason = policy.check(method, context)
            if reason is not None:
                context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{method}: {reason}")
            return behavior(request, context)
        return checked
    return _rebuild(handler, guard)


def _wrap_aio(handler: grpc.RpcMethodHandler, method: str, policy: RolePolicy) -> grpc.RpcMethodHandler:
    def guard_unary(behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def checked(request: Any, context: grpc.aio.ServicerContext) -> Any:
            reason = policy.check(method, context)
            if reason is not None:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{method}: {reason}")
            return await behavior(request, context)
        return checked

    def guard_stream(behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def checked(request: Any, context: grpc.aio.ServicerContext) -> Any:
            reason = policy.check(method, context)
            if reason is not None:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{method}: {reason}")
            result = behavior(request, context)
            if hasattr(result, "__aiter__"):
                async for item in result:
                    yield item
            else:  # a handler that writes through context.write and returns
                await result
        return checked

    return _rebuild(handler, guard_unary if not handler.response_streaming else guard_stream)


def _rebuild(handler: grpc.RpcMethodHandler, guard: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Any:
    kinds = {(False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
             (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
             (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
             (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler)}
    attr, make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(guard(getattr(handler, attr)), request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


class RoleInterceptor(grpc.ServerInterceptor):
    def __init__(self, policy: RolePolicy) -> None:
        self.policy = policy

    def intercept_service(self, continuation: Callable[..., Any], handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method not in self.policy.allowed:
            return handler
        return _wrap_sync(handler, handler_call_details.method, self.policy)


class AioRoleInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, policy: RolePolicy) -> None:
        self.policy = policy

    async def intercept_service(self, continuation: Callable[..., Any], handler_call_details: Any) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method not in self.policy.allowed:
            return handler
        return _wrap_aio(handler, handler_call_details.method, self.policy)
