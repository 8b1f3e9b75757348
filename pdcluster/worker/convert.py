"""The worker's responses: engine outputs -> WorkerGenerateResponse.

    RequestOutput delta   --output_to_response---------->  WorkerGenerateResponse
    the deltas of one request --merge_responses---------->  one response (stream=false)

Sampling and KV-transfer parameters, finish reasons and roles convert in pdcluster.proto_convert
(shared with the router and the client); its names are re-exported here for the worker's callers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pdcluster._proto import common_pb2, worker_pb2
from pdcluster.engine.outputs import Logprob, RequestOutput, SampleLogprobs
from pdcluster.proto_convert import (
    FINISH_REASON_FROM_PROTO,
    FINISH_REASON_TO_PROTO,
    ROLE_FROM_PROTO,
    ROLE_TO_PROTO,
    ec_params_from_proto,
    ec_params_to_proto,
    kv_params_from_proto,
    kv_params_to_proto,
    sampling_params_from_proto,
    sampling_params_to_proto,
)


# -- outputs --------------------------------------------------------------------------------------
def _token_logprob(lp: Logprob, token_text: Callable[[int], str] | None) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank,
                                   decoded=token_text(lp.token_id) if token_text is not None else "")


def logprobs_to_proto(
    logprobs: Sequence[SampleLogprobs], token_text: Callable[[int], str] | None = None
) -> list[common_pb2.SampleLogprobs]:
    return [
        common_pb2.SampleLogprobs(sampled=_token_logprob(s.sampled, token_text),
                                  top=[_token_logprob(t, token_text) for t in s.top])
        for s in logprobs
    ]


def set_stop_reason(msg: Any, stop_reason: int | str | None) -> None:
    """Fill the `stop_reason` oneof of a Worker/Router GenerateResponse."""
    if isinstance(stop_reason, str):
        msg.stop_str = stop_reason
    elif isinstance(stop_reason, int) and not isinstance(stop_reason, bool):
        msg.stop_token_id = stop_reason


def output_to_response(
    out: RequestOutput,
    *,
    arrival_time: float,
    num_completion_tokens: int,
    token_text: Callable[[int], str] | None = None,
) -> worker_pb2.WorkerGenerateResponse:
    """One engine delta as one response. num_completion_tokens counts every token generated so
    far including this delta (it becomes usage.completion_tokens on the final response)."""
    comp = out.outputs[0]
    resp = worker_pb2.WorkerGenerateResponse(
        request_id=out.request_id,
        token_ids=comp.token_ids,
        text=comp.text,
        token_arrival_times=[arrival_time] * len(comp.token_ids),
        finished=out.finished,
        finish_reason=FINISH_REASON_TO_PROTO.get(comp.finish_reason, common_pb2.FINISH_REASON_ERROR),
    )
    if comp.logprobs:
        resp.logprobs.extend(logprobs_to_proto(comp.logprobs, token_text))
    if out.prompt_logprobs:
        resp.prompt_logprobs.extend(logprobs_to_proto(out.prompt_logprobs, token_text))
    if out.finished:
        set_stop_reason(resp, comp.stop_reason)
        resp.usage.CopyFrom(common_pb2.Usage(prompt_tokens=len(out.prompt_token_ids),
                                             completion_tokens=num_completion_tokens,
                                             cached_tokens=out.num_cached_tokens))
        if out.error:
            resp.error_message = out.error
            resp.error_field = out.error_field or ""
            resp.finish_reason = common_pb2.FINISH_REASON_ERROR
        if out.kv_transfer_params is not None:
            resp.kv_transfer_params.CopyFrom(kv_params_to_proto(out.kv_transfer_params))
        ec = getattr(out, "ec_transfer_params", None)  # what this engine now holds for other instances
        if ec is not None:
            resp.ec_transfer_params.CopyFrom(ec_params_to_proto(ec))
    return resp


def merge_responses(responses: Sequence[worker_pb2.WorkerGenerateResponse]) -> worker_pb2.WorkerGenerateResponse:
    """Concatenate a request's deltas into one response (stream=false); the final fields come
    from the last one."""
    merged = worker_pb2.WorkerGenerateResponse()
    for r in responses:
        merged.token_ids.extend(r.token_ids)
        merged.logprobs.extend(r.logprobs)
        merged.prompt_logprobs.extend(r.prompt_logprobs)
        merged.token_arrival_times.extend(r.token_arrival_times)
    if responses:
        last = responses[-1]
        merged.request_id = last.request_id
        merged.text = "".join(r.text for r in responses)
        merged.finished, merged.finish_reason = last.finished, last.finish_reason
        merged.error_message, merged.error_field = last.error_message, last.error_field
        if last.HasField("usage"):
            merged.usage.CopyFrom(last.usage)
        which = last.WhichOneof("stop_reason")
        if which is not None:
            setattr(merged, which, getattr(last, which))
        if last.HasField("kv_transfer_params"):
            merged.kv_transfer_params.CopyFrom(last.kv_transfer_params)
        if last.HasField("ec_transfer_params"):
            merged.ec_transfer_params.CopyFrom(last.ec_transfer_params)
    return merged


__all__ = [
    "FINISH_REASON_FROM_PROTO", "FINISH_REASON_TO_PROTO", "ROLE_FROM_PROTO", "ROLE_TO_PROTO",
    "ec_params_from_proto", "ec_params_to_proto", "kv_params_from_proto",
    "kv_params_to_proto", "logprobs_to_proto", "merge_responses", "output_to_response", "sampling_params_from_proto",
    "sampling_params_to_proto", "set_stop_reason",
]
