"""Conversions between the wire messages the router sees: proto SamplingParams <-> the validated
dataclass, and a worker's response -> the client's response."""

from __future__ import annotations

from pdcluster import proto_convert
from pdcluster._proto import common_pb2, router_pb2, worker_pb2
from pdcluster.sampling_params import SamplingParams

from .errors import RouterError, invalid


def sampling_params_from_proto(pb: common_pb2.SamplingParams) -> SamplingParams:
    """Validate (pdcluster.proto_convert, shared with the worker): unset optional fields take the
    dataclass defaults; a bad value raises INVALID_ARGUMENT naming the field."""
    try:
        return proto_convert.sampling_params_from_proto(pb)
    except proto_convert.InvalidField as e:
        raise invalid(e.field, e.detail) from None


def response_from_worker(w: worker_pb2.WorkerGenerateResponse, request_id: str) -> router_pb2.GenerateResponse:
    """The client's view of one worker delta. Built field by field: the two messages share field
    numbers 1-11 but differ at 12, so a byte-level copy would be wrong."""
    r = router_pb2.GenerateResponse(request_id=request_id, token_ids=w.token_ids, text=w.text,
                                    token_arrival_times=w.token_arrival_times, finished=w.finished,
                                    finish_reason=w.finish_reason, error_message=w.error_message,
                                    error_field=w.error_field)
    if w.logprobs:
        r.logprobs.extend(w.logprobs)
    if w.prompt_logprobs:
        r.prompt_logprobs.extend(w.prompt_logprobs)
    which = w.WhichOneof("stop_reason")
    if which == "stop_token_id":
        r.stop_token_id = w.stop_token_id
    elif which == "stop_str":
        r.stop_str = w.stop_str
    if w.HasField("usage"):
        r.usage.CopyFrom(w.usage)
    return r


def error_response(request_id: str, err: RouterError) -> worker_pb2.WorkerGenerateResponse:
    """A stream that fails after its first token ends with this message instead of a status:
    the client already has tokens and needs to know why no more come."""
    return worker_pb2.WorkerGenerateResponse(
        request_id=request_id, finished=True, finish_reason=common_pb2.FINISH_REASON_ERROR,
        error_message=f"{err.code.name}: {err.message}",
    )
