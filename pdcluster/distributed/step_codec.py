"""SchedulerOutput <-> plain dict <-> msgpack bytes, for rank 0's per-step broadcast.

No pickle crosses a process boundary (DESIGN.md section 9): every field is written out
explicitly, sampling params travel as SamplingParams.to_dict(), and decoding goes through
`unpack_bounded` (size checked first, no ext types) and then the SamplingParams validator.

    control message = {"v": 1, "kind": "step", "step": <scheduler output dict>}
                    | {"v": 1, "kind": "shutdown"}

    scheduler output dict:
        "new":      [[request_id, prompt_token_ids, output_token_ids, sampling_params dict,
                      block_ids, num_computed_tokens, eos_token_ids], ...]
        "cached":   [[request_id, new_block_ids, num_computed_tokens], ...]
        "sched":    {request_id: num_scheduled_tokens}
        "total":    total_num_scheduled_tokens
        "finished": [request_id, ...]
        "kv":       kv_connector_metadata.to_dict() | None   (rebuilt by the rank's connector)
        "spec":     {request_id: draft token ids}                (absent: none)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack

from pdcluster.engine.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from pdcluster.sampling_params import SamplingParams
from pdcluster.security.envelope import MalformedMessage, unpack_bounded

WIRE_VERSION = 1
# A step of 4096 requests with 32k-token prompts is ~0.5 GB of ids; no sane step comes close to
# this bound, and a receiver refuses a bigger length before allocating.
MAX_CONTROL_MESSAGE_BYTES = 1 << 30
KIND_STEP, KIND_SHUTDOWN = "step", "shutdown"


def scheduler_output_to_dict(step: SchedulerOutput) -> dict[str, Any]:
    meta = step.kv_connector_metadata
    if meta is not None and not hasattr(meta, "to_dict"):
        raise ValueError(f"kv_connector_metadata {type(meta).__name__} has no to_dict(): it cannot be broadcast")
    return {
        "new": [[r.request_id, list(r.prompt_token_ids), list(r.output_token_ids), r.sampling_params.to_dict(),
                 list(r.block_ids), r.num_computed_tokens, list(r.eos_token_ids)]
                for r in step.scheduled_new_reqs],
        "cached": [[r.request_id, list(r.new_block_ids), r.num_computed_tokens]
                   for r in step.scheduled_cached_reqs],
        "sched": dict(step.num_scheduled_tokens),
        "total": step.total_num_scheduled_tokens,
        "finished": sorted(step.finished_request_ids),
        "kv": meta.to_dict() if meta is not None else None,
        "spec": {r: list(ids) for r, ids in step.scheduled_spec_token_ids.items()},
    }


def scheduler_output_from_dict(d: dict[str, Any], meta_decoder: Callable[[dict[str, Any]], Any] | None = None
                               ) -> SchedulerOutput:
    """meta_decoder rebuilds kv_connector_metadata from its dict (the rank's connector); without
    one a non-empty "kv" is refused."""
    try:
        new = [NewRequestData(_str(request_id), _ints(prompt), _ints(out), SamplingParams.from_dict(_map(params)),
                              _ints(blocks), _int(num_computed), tuple(_ints(eos)))
               for request_id, prompt, out, params, blocks, num_computed, eos in d["new"]]
        cached = [CachedRequestData(_str(request_id), _ints(blocks), _int(num_computed))
                  for request_id, blocks, num_computed in d["cached"]]
        sched = {_str(k): _int(v) for k, v in _map(d["sched"]).items()}
        step = SchedulerOutput(new, cached, sched, _int(d["total"]), {_str(r) for r in d["finished"]})
        step.scheduled_spec_token_ids = {_str(k): _ints(v) for k, v in _map(d.get("spec") or {}).items()}
        kv = d.get("kv")
        if kv is not None:
            if meta_decoder is None:
                raise MalformedMessage("step carries kv_connector_metadata but this rank has no connector")
            step.kv_connector_metadata = meta_decoder(_map(kv))
        return step
    except MalformedMessage:
        raise
    except (KeyError, TypeError, ValueError) as e:  # wrong shape, wrong types, bad sampling params
        raise MalformedMessage(f"malformed scheduler output: {e!r}") from e


def encode_step(step: SchedulerOutput) -> bytes:
    return msgpack.packb({"v": WIRE_VERSION, "kind": KIND_STEP, "step": scheduler_output_to_dict(step)},
                         use_bin_type=True)


def encode_shutdown() -> bytes:
    return msgpack.packb({"v": WIRE_VERSION, "kind": KIND_SHUTDOWN}, use_bin_type=True)


def decode_control(data: bytes, meta_decoder: Callable[[dict[str, Any]], Any] | None = None
                   ) -> tuple[str, SchedulerOutput | None]:
    """-> (kind, scheduler output or None). MalformedMessage for anything else."""
    msg = unpack_bounded(data, MAX_CONTROL_MESSAGE_BYTES)
    if not isinstance(msg, dict) or msg.get("v") != WIRE_VERSION:
        raise MalformedMessage(f"control message of unknown version: {type(msg).__name__}")
    kind = msg.get("kind")
    if kind == KIND_SHUTDOWN:
        return kind, None
    if kind == KIND_STEP:
        return kind, scheduler_output_from_dict(_map(msg.get("step")), meta_decoder)
    raise MalformedMessage(f"unknown control message kind {kind!r}")


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise MalformedMessage(f"expected an integer, got {type(v).__name__}")
    return v


def _ints(v: Any) -> list[int]:
    if not isinstance(v, list):
        raise MalformedMessage(f"expected a list of integers, got {type(v).__name__}")
    return [_int(x) for x in v]


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise MalformedMessage(f"expected a string, got {type(v).__name__}")
    return v


def _map(v: Any) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise MalformedMessage(f"expected a map, got {type(v).__name__}")
    return v


def encode_report(finished_sending: set[str], finished_recving: set[str], failed_blocks: set[int]) -> bytes:
    """One rank's connector report of a step, gathered to rank 0."""
    return msgpack.packb([sorted(finished_sending), sorted(finished_recving), sorted(failed_blocks)],
                         use_bin_type=True)


def decode_report(data: bytes, max_len: int) -> tuple[set[str], set[str], set[int]]:
    msg = unpack_bounded(data, max_len)
    if not isinstance(msg, list) or len(msg) != 3:
        raise MalformedMessage("malformed connector report")
    sending, recving, failed = msg
    if not isinstance(sending, list) or not isinstance(recving, list):
        raise MalformedMessage("malformed connector report")
    return {_str(r) for r in sending}, {_str(r) for r in recving}, set(_ints(failed))
