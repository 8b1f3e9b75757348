"""The one place the wire (protobuf) meets the core's plain types; used by router, worker and client.

Imports no torch and no engine loop: only the proto stubs and plain dataclasses.

    proto SamplingParams   --sampling_params_from_proto-->  SamplingParams (validated; InvalidField)
    SamplingParams         --sampling_params_to_proto---->  proto SamplingParams (only non-defaults)
    proto KvTransferParams <--kv_params_{to,from}_proto-->  KVTransferParams (validated; ValueError)
    proto EcTransferParams <--ec_params_{to,from}_proto-->  ECTransferParams (validated; ValueError)
    finish reasons and worker roles <-> their proto enums

`extra` on the wire is the proto's map<string, string>: a str value travels under its own key,
unchanged; any other value (bytes, int, float, bool, a list) under `key:mp`, as base64 of its
msgpack encoding, so it comes back with its type. Extra keys never contain ':' (KVTransferParams
checks), so the two never collide.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
from typing import Any

import msgpack

from pdcluster._proto import common_pb2
from pdcluster.engine.ec_transfer_params import ECItemRef, ECTransferParams
from pdcluster.engine.kv_transfer_params import KVTransferParams
from pdcluster.sampling_params import SamplingParams

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
    "encode": common_pb2.WORKER_ROLE_ENCODE,
}
ROLE_FROM_PROTO = {v: k for k, v in ROLE_TO_PROTO.items()}

# Derived by the engine that receives the request (from bad_words): never on the wire.
ENGINE_ONLY_FIELDS = frozenset({"bad_words_token_ids"})
_SP_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams)
                   if f.name != "extra" and f.name not in ENGINE_ONLY_FIELDS)
_SP_REPEATED = frozenset({"stop", "stop_token_ids", "allowed_token_ids", "bad_words"})
_SP_MESSAGES = frozenset({"structured_outputs", "logit_bias"})  # converted by hand below
_SO_FIELDS = ("json", "regex", "choice", "grammar", "json_object")
_KV_FIELDS = frozenset(f.name for f in dataclasses.fields(KVTransferParams)) - {"extra"}
_TYPED_SUFFIX = ":mp"


class InvalidField(ValueError):
    """A sampling parameter the request got wrong. str(): `sampling_params.<detail>`; `field` is
    the SamplingParams field the detail starts with (or "sampling_params"), `detail` its message."""

    def __init__(self, field: str, detail: str) -> None:
        super().__init__(f"sampling_params.{detail}")
        self.field, self.detail = field, detail


# -- sampling params ------------------------------------------------------------------------------
def sampling_params_from_proto(msg: common_pb2.SamplingParams | None) -> SamplingParams:
    """Unset optional fields keep SamplingParams' defaults; range checks are SamplingParams' own
    (one place), re-raised as InvalidField naming the field."""
    if msg is None:
        return SamplingParams()
    kwargs: dict[str, Any] = {}
    for name in _SP_FIELDS:
        if name in _SP_MESSAGES:
            continue
        if name in _SP_REPEATED:
            values = list(getattr(msg, name))
            if values:
                kwargs[name] = values
        elif msg.HasField(name):
            kwargs[name] = getattr(msg, name)
    if msg.logit_bias:
        kwargs["logit_bias"] = dict(msg.logit_bias)
    if msg.HasField("structured_outputs"):
        so = msg.structured_outputs
        kwargs["structured_outputs"] = {k: (list(so.choice) if k == "choice" else getattr(so, k))
                                        for k in _SO_FIELDS if (so.choice if k == "choice" else so.HasField(k))}
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        detail = str(e)
        first = detail.split(" ", 1)[0].rstrip(":").split(".", 1)[0]
        raise InvalidField(first if first in _SP_FIELDS else "sampling_params", detail) from None


def sampling_params_to_proto(params: SamplingParams | None) -> common_pb2.SamplingParams:
    """Only fields that differ from the defaults are set, so the receiver's defaults apply."""
    msg = common_pb2.SamplingParams()
    if params is None:
        return msg
    default = SamplingParams()
    for name in _SP_FIELDS:
        value = getattr(params, name)
        if name in _SP_MESSAGES:
            continue
        if name in _SP_REPEATED:
            getattr(msg, name).extend(value)
        elif value is not None and value != getattr(default, name):
            setattr(msg, name, value)
    for token_id, bias in params.logit_bias:
        msg.logit_bias[token_id] = bias
    so = params.structured_outputs
    if so is not None:
        for k, v in so.to_dict().items():
            if k == "choice":
                msg.structured_outputs.choice.extend(v)
            else:
                setattr(msg.structured_outputs, k, v)
    return msg


# -- KV transfer params ---------------------------------------------------------------------------
def kv_params_from_proto(msg: common_pb2.KvTransferParams) -> KVTransferParams:
    """The set fields as a KVTransferParams; ValueError naming a malformed field or extra entry."""
    kwargs: dict[str, Any] = {}
    for fd, value in msg.ListFields():
        if fd.name == "extra":
            kwargs["extra"] = _extra_from_proto(dict(value))
        elif fd.is_repeated:
            kwargs[fd.name] = list(value)
        else:
            kwargs[fd.name] = value
    return KVTransferParams(**kwargs)


def kv_params_to_proto(params: KVTransferParams) -> common_pb2.KvTransferParams:
    """Every non-default field into its proto field; `extra` encoded as the module docstring says."""
    msg = common_pb2.KvTransferParams()
    for name, value in params.to_wire().items():
        if name == "extra":
            for key, v in value.items():
                if isinstance(v, str):
                    msg.extra[key] = v
                else:
                    msg.extra[key + _TYPED_SUFFIX] = base64.b64encode(msgpack.packb(v, use_bin_type=True)).decode()
        elif name in _KV_FIELDS:
            field = getattr(msg, name)
            if isinstance(value, list):
                field.extend(value)
            else:
                setattr(msg, name, value)
    return msg


def _extra_from_proto(raw: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, text in raw.items():
        if not key.endswith(_TYPED_SUFFIX):
            out[key] = text
            continue
        name = key[: -len(_TYPED_SUFFIX)]
        try:
            value = msgpack.unpackb(base64.b64decode(text, validate=True), raw=False, max_ext_len=0,
                                    strict_map_key=True)
        except (binascii.Error, ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
            raise ValueError(f"kv_transfer_params.extra[{name!r}]: not a valid typed value ({e})") from None
        if isinstance(value, dict):
            raise ValueError(f"kv_transfer_params.extra[{name!r}]: maps are not extra values")
        out[name] = value
    return out


# -- EC transfer params ---------------------------------------------------------------------------
def ec_params_from_proto(msg: common_pb2.EcTransferParams) -> ECTransferParams:
    """The proto as an ECTransferParams; ValueError naming a malformed field."""
    items = tuple(ECItemRef(mm_hash=i.mm_hash, lease_id=i.lease_id, nbytes=i.nbytes, num_tokens=i.num_tokens)
                  for i in msg.items)
    return ECTransferParams(connector=msg.connector, producer_id=msg.producer_id, address=msg.address,
                            public_key=msg.public_key, fingerprint=msg.fingerprint,
                            engine_epoch=msg.engine_epoch, expires_at=msg.expires_at, items=items)


def ec_params_to_proto(params: ECTransferParams) -> common_pb2.EcTransferParams:
    msg = common_pb2.EcTransferParams(
        connector=params.connector, producer_id=params.producer_id, address=params.address,
        public_key=params.public_key, fingerprint=params.fingerprint, engine_epoch=params.engine_epoch,
        expires_at=params.expires_at)
    for i in params.items:
        msg.items.add(mm_hash=i.mm_hash, lease_id=i.lease_id, nbytes=i.nbytes, num_tokens=i.num_tokens)
    return msg


__all__ = [
    "FINISH_REASON_FROM_PROTO", "FINISH_REASON_TO_PROTO", "InvalidField", "ROLE_FROM_PROTO", "ROLE_TO_PROTO",
    "ec_params_from_proto", "ec_params_to_proto",
    "kv_params_from_proto", "kv_params_to_proto", "sampling_params_from_proto", "sampling_params_to_proto",
]
