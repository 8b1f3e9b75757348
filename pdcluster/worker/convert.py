"""Conversions between the wire (protobuf) and the engine's Python types.

Used by the worker servicer, the router and the client, so it imports neither torch nor the
engine loop: only the plain dataclasses (SamplingParams, RequestOutput, SampleLogprobs).

    proto SamplingParams  --sampling_params_from_proto-->  SamplingParams (validated; ValueError)
    SamplingParams        --sampling_params_to_proto---->  proto SamplingParams (only non-defaults)
    proto KvTransferParams <--kv_params_{to,from}_proto-->  dict (the engine's kv_transfer_params)
    RequestOutput delta   --output_to_response---------->  WorkerGenerateResponse
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pdcluster._proto import common_pb2, worker_pb2
from pdcluster.engine.outputs import Logprob, RequestOutput, SampleLogprobs
from pdcluster.sampling_params import SamplingParams

# Engine finish_reason strings <-> proto enum.
FINISH_REASON_TO_PROTO = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
    "error": common_pb2.FINISH_REASON_ERROR,
}
FINISH_REASON_FROM_PROTO = {v: k for k, v in FINISH_REASON_TO_PROTO.items()}

ROLE_TO_PROTO = {
    "prefill": common_pb2.WORKER_ROLE_PREFILL,
    "decode": common_pb2.WORKER_ROLE_DECODE,
    "both": common_pb2.WORKER_ROLE_BOTH,
}
ROLE_FROM_PROTO = {v: k for k, v in ROLE_TO_PROTO.items()}

_SP_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.name != "extra")
_SP_REPEATED = frozenset({"stop", "stop_token_ids"})
_KV_FIELDS = {f.name: f for f in common_pb2.KvTransferParams.DESCRIPTOR.fields}
_MAX_EXTRA_VALUE_LEN = 4096


# -- sampling params ------------------------------------------------------------------------------
def sampling_params_from_proto(msg: common_pb2.SamplingParams | None) -> SamplingParams:
    """Unset optional fields keep SamplingParams' defaults; range checks are SamplingParams' own
    (one place), re-raised as ValueError prefixed with `sampling_params.` so the field is named."""
    if msg is None:
        return SamplingParams()
    kwargs: dict[str, Any] = {}
    for name in _SP_FIELDS:
        if name in _SP_REPEATED:
            values = list(getattr(msg, name))
            if values:
                kwargs[name] = values
        elif msg.HasField(name):
            kwargs[name] = getattr(msg, name)
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        raise ValueError(f"sampling_params.{e}") from None


def sampling_params_to_proto(params: SamplingParams | None) -> common_pb2.SamplingParams:
    """Only fields that differ from the defaults are set, so the receiver's defaults apply."""
    msg = common_pb2.SamplingParams()
    if params is None:
        return msg
    default = SamplingParams()
    for name in _SP_FIELDS:
        value = getattr(params, name)
        if name in _SP_REPEATED:
            getattr(msg, name).extend(value)
        elif value is not None and value != getattr(default, name):
            setattr(msg, name, value)
    return msg


# -- KV transfer params ---------------------------------------------------------------------------
def kv_params_from_proto(msg: common_pb2.KvTransferParams) -> dict[str, Any]:
    """The set fields as a dict with the proto's field names (`extra` as a dict of strings)."""
    out: dict[str, Any] = {}
    for fd, value in msg.ListFields():
        if fd.name == "extra":
            out["extra"] = dict(value)
        elif fd.is_repeated:
            out[fd.name] = list(value)
        else:
            out[fd.name] = value
    return out


def kv_params_to_proto(params: Mapping[str, Any]) -> common_pb2.KvTransferParams:
    """Keys named like a proto field fill that field; anything else goes to `extra` as a string
    (so a plugin connector's private keys survive the trip through the router)."""
    msg = common_pb2.KvTransferParams()
    for key, value in params.items():
        if value is None:
            continue
        fd = _KV_FIELDS.get(key)
        if key == "extra":
            for k, v in dict(value).items():
                msg.extra[str(k)] = str(v)[:_MAX_EXTRA_VALUE_LEN]
        elif fd is None:
            msg.extra[str(key)] = str(value)[:_MAX_EXTRA_VALUE_LEN]
        elif fd.is_repeated:
            getattr(msg, key).extend(value)
        else:
            setattr(msg, key, value)
    return msg


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
    if out.finished:
        set_stop_reason(resp, comp.stop_reason)
        resp.usage.CopyFrom(common_pb2.Usage(prompt_tokens=len(out.prompt_token_ids),
                                             completion_tokens=num_completion_tokens,
                                             cached_tokens=out.num_cached_tokens))
        if out.error:
            resp.error_message = out.error
            resp.finish_reason = common_pb2.FINISH_REASON_ERROR
        if out.kv_transfer_params:
            resp.kv_transfer_params.CopyFrom(kv_params_to_proto(out.kv_transfer_params))
    return resp


def merge_responses(responses: Sequence[worker_pb2.WorkerGenerateResponse]) -> worker_pb2.WorkerGenerateResponse:
    """Concatenate a request's deltas into one response (stream=false); the final fields come
    from the last one."""
    merged = worker_pb2.WorkerGenerateResponse()
    for r in responses:
        merged.token_ids.extend(r.token_ids)
        merged.logprobs.extend(r.logprobs)
        merged.token_arrival_times.extend(r.token_arrival_times)
    if responses:
        last = responses[-1]
        merged.request_id = last.request_id
        merged.text = "".join(r.text for r in responses)
        merged.finished, merged.finish_reason = last.finished, last.finish_reason
        merged.error_message = last.error_message
        if last.HasField("usage"):
            merged.usage.CopyFrom(last.usage)
        which = last.WhichOneof("stop_reason")
        if which is not None:
            setattr(merged, which, getattr(last, which))
        if last.HasField("kv_transfer_params"):
            merged.kv_transfer_params.CopyFrom(last.kv_transfer_params)
    return merged
