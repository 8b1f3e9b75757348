"""RouterError: one error type for every refusal the router answers, in gRPC and HTTP terms.

Raised by validation, admission control and the orchestrator; the gRPC frontend turns it into a
status code, the HTTP frontend into an OpenAI-style error body:

    {"error": {"message": ..., "type": ..., "param": <field or null>, "code": <http status>}}
"""

from __future__ import annotations

import dataclasses

import grpc

from pdcluster.sampling_params import SamplingParams

# gRPC code -> (HTTP status, OpenAI error type). 499 is nginx's "client closed request".
_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "BadRequestError"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "BadRequestError"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "BadRequestError"),
    grpc.StatusCode.NOT_FOUND: (404, "NotFoundError"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "ConflictError"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "RateLimitError"),
    grpc.StatusCode.CANCELLED: (499, "CancelledError"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "NotImplementedError"),
    grpc.StatusCode.UNAVAILABLE: (503, "ServiceUnavailableError"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "TimeoutError"),
}


class RouterError(Exception):
    """A request the router refuses or cannot finish. `field` names the offending request field
    (OpenAI's `param`), when there is one."""

    def __init__(self, code: grpc.StatusCode, message: str, field: str | None = None,
                 http_status: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field
        self._http_status = http_status

    @property
    def http_status(self) -> int:
        return self._http_status or _HTTP.get(self.code, (500, ""))[0]

    def openai_body(self) -> dict:
        err_type = _HTTP.get(self.code, (500, "InternalServerError"))[1]
        if self._http_status == 413:
            err_type = "RequestTooLargeError"
        return {"error": {"message": self.message, "type": err_type, "param": self.field,
                          "code": self.http_status}}

    def __repr__(self) -> str:
        return f"RouterError({self.code.name}, {self.message!r}, field={self.field!r})"


def invalid(field: str, message: str) -> RouterError:
    """INVALID_ARGUMENT naming the field; the message starts with the field too, so gRPC
    clients (which only see the text) know which one."""
    text = message if message.startswith(field) else f"{field}: {message}"
    return RouterError(grpc.StatusCode.INVALID_ARGUMENT, text, field)


_SAMPLING_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(SamplingParams)) - {"extra"}


def worker_verdict(code: grpc.StatusCode, message: str) -> RouterError:
    """A worker's refusal of the request itself. Engine refusals start with the sampling field
    they concern ("priority=3: ...", "allowed_token_ids: ..."): that field becomes the error's,
    so HTTP clients get it as `param` as they do for the router's own checks."""
    field = None
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        head = message.removeprefix("sampling_params.").split(" ", 1)[0]
        head = head.split(":", 1)[0].split("=", 1)[0].split(".", 1)[0]
        field = head if head in _SAMPLING_FIELD_NAMES else None
    return RouterError(code, message, field)


def leg_failure(message: str, field: str = "") -> RouterError:
    """A leg that ended with finish_reason ERROR after it started: the request's own fault when
    the worker names a field (its constraints left no token to sample: 400 naming it), else the
    worker's (500)."""
    if field:
        return invalid(field, message)
    return RouterError(grpc.StatusCode.INTERNAL, message or "generation failed")


def unavailable(message: str) -> RouterError:
    return RouterError(grpc.StatusCode.UNAVAILABLE, message)
