"""Client authentication on the router's frontends (vLLM's `--api-key`), and the start-up rule for
exposed addresses.

    HTTP   `Authorization: Bearer <key>` on every path but /health and /metrics, which stay open as
           in vLLM (load balancers and scrapers probe them without credentials). vLLM guards only
           /v1/*; here /tokenize and /detokenize (chat templates, tools: CPU on the router's loop)
           and unknown paths need the key too, so nothing but the two probes answers a stranger.
    gRPC   metadata `authorization: Bearer <key>` on every Router method; the standard health
           service stays open for the same reason

Keys are compared in constant time, as SHA-256 digests (equal lengths whatever was sent). A
refusal is 401 / UNAUTHENTICATED and says nothing about the expected key.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import grpc
from aiohttp import web

_OPEN_GRPC_PREFIX = "/grpc.health.v1.Health/"
_OPEN_HTTP_PATHS = frozenset({"/health", "/metrics"})
_LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost", "ip6-loopback"})


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


class ApiKey:
    """The keys a router accepts (vLLM's --api-key takes several: a new key can be handed out
    beside the old one, the clients moved over, and the old one dropped at the next start)."""

    def __init__(self, keys: str | Sequence[str]) -> None:
        keys = (keys,) if isinstance(keys, str) else tuple(keys)
        if not keys or not all(isinstance(k, str) and k for k in keys):
            raise ValueError("api_key must not be empty")
        self._want = tuple(_digest(f"Bearer {k}") for k in keys)

    def check(self, authorization: str | None) -> bool:
        # Always compare with every key (an absent header hashes ""): no early return that times
        # differently with the header or with which key matched.
        got = _digest(authorization or "")
        return sum(hmac.compare_digest(got, want) for want in self._want) > 0

    # -- HTTP ---------------------------------------------------------------------------------------
    def http_middleware(self) -> Callable[..., Awaitable[web.StreamResponse]]:
        @web.middleware
        async def require_api_key(request: web.Request, handler: Any) -> web.StreamResponse:
            # request.path is the decoded, unnormalised path: "/health/" or "//health" are not open.
            if request.path not in _OPEN_HTTP_PATHS and not self.check(request.headers.get("Authorization")):
                body = {"error": {"message": "Unauthorized: a valid 'Authorization: Bearer <api key>' header "
                                             "is required", "type": "AuthenticationError", "param": None,
                                  "code": 401}}
                return web.json_response(body, status=401, headers={"WWW-Authenticate": "Bearer"})
            return await handler(request)

        return require_api_key

    # -- gRPC ---------------------------------------------------------------------------------------
    def grpc_interceptor(self) -> grpc.aio.ServerInterceptor:
        return _GrpcApiKey(self)


class _GrpcApiKey(grpc.aio.ServerInterceptor):
    def __init__(self, key: ApiKey) -> None:
        self._key = key

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(_OPEN_GRPC_PREFIX):
            return handler
        if self._key.check(_metadata_value(details.invocation_metadata or (), "authorization")):
            return handler
        return _refusing(handler)


def _metadata_value(metadata: Iterable[Any], name: str) -> str | None:
    for item in metadata:
        key, value = item[0], item[1]
        if key == name:
            return value if isinstance(value, str) else None
    return None


async def _unauthenticated(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                        "a valid 'authorization: Bearer <api key>' metadata entry is required")


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as the real one that only refuses (the request is parsed by
    the real deserializer, which the message size limit already bounds)."""
    kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_unauthenticated, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_unauthenticated, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_unauthenticated, **kw)
    return grpc.unary_unary_rpc_method_handler(_unauthenticated, **kw)


# -- exposure -----------------------------------------------------------------------------------
def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname other than localhost: assume it is reachable from elsewhere


def check_exposure(host: str, *, tls: bool, api_key: bool, insecure: bool, what: str = "the router") -> None:
    """Refuse to serve a non-loopback address in plaintext and without a key, unless told to."""
    if is_loopback(host) or tls or api_key or insecure:
        return
    raise ValueError(f"{what} would listen on {host!r} (not loopback) with neither TLS nor an API key: anyone who "
                     "reaches it could use it. Give --api-key and/or --ssl-certfile/--ssl-keyfile, bind 127.0.0.1, "
                     "or pass --insecure to accept this")
