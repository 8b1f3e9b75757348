"""KVTransferParams: what a producer's request_finished hands to the consumer leg, typed.

Part of the connector contract (re-exported by pdcluster.engine.kv_connector). One frozen value
travels the whole way: connector -> engine output -> worker (proto, pdcluster.proto_convert) ->
router (copied as the proto) -> decode worker -> engine -> connector. Every field is checked when
the value is built, so a malformed hand-off fails where it enters, with the field named.

The fields are those of the proto's KvTransferParams (proto/pdcluster/v1/common.proto): what
every connector has (connector, producer_id, engine_epoch, request_id, lease_id, num_tokens and
block_ids or store_keys) and what the built-in P2P connector needs to find its producer; a field
a connector does not use stays at its default (proto3 leaves it off the wire).

`extra` is for what is specific to one connector (a plugin's private values, the P2P signature,
the store's key prefix): a small, bounded map str -> str | bytes | int | float | bool, or a list of
those. A connector that keeps several values there is clearest with its own small dataclass that
converts to and from `extra` (see connectors/p2p/params.py P2PExtra, connectors/store/meta.py
StoreHandoff), so the core type does not grow a field per connector.

    to_wire() / from_wire()   plain msgpack-able dict (only non-default fields; tuples as lists)
                              <-> the value; from_wire refuses unknown or malformed fields by name
    for_decode_leg()          the same params with do_remote_prefill set (what the router sends)
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

ExtraScalar = str | bytes | int | float | bool
ExtraValue = ExtraScalar | tuple[ExtraScalar, ...]

MAX_EXTRA_ENTRIES = 32
MAX_EXTRA_VALUE_BYTES = 4096  # one value (a list: all its items)
MAX_EXTRA_BYTES = 16384  # every key and value together
MAX_EXTRA_LIST_ITEMS = 256
MAX_BLOCKS = 1 << 20  # block ids, store keys, block hashes
MAX_STR = 1024  # ids, endpoints, hosts
MAX_BYTES = 1024  # public key, transfer token, one block hash
_U32, _U64 = (1 << 32) - 1, (1 << 64) - 1
_I64 = 1 << 63
EXTRA_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")

_WHERE = "kv_transfer_params"


def _fail(name: str, what: str, value: Any) -> ValueError:
    return ValueError(f"{_WHERE}.{name}: {what}, got {str(value)[:80]!r}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_int(name: str, v: Any, top: int) -> None:
    if not _is_int(v) or not 0 <= v <= top:
        raise _fail(name, f"must be an integer in [0, {top}]", v)


def _check_str(name: str, v: Any, limit: int = MAX_STR) -> None:
    if not isinstance(v, str) or len(v) > limit:
        raise _fail(name, f"must be a string of at most {limit} characters", v)


def _as_bytes(name: str, v: Any, limit: int = MAX_BYTES) -> bytes:
    if not isinstance(v, (bytes, bytearray, memoryview)) or len(v) > limit:
        raise _fail(name, f"must be at most {limit} bytes", v)
    return bytes(v)


def _as_seq(name: str, v: Any) -> tuple[Any, ...]:
    if not isinstance(v, (list, tuple)) or len(v) > MAX_BLOCKS:
        raise _fail(name, f"must be a list of at most {MAX_BLOCKS} items", v)
    return tuple(v)


def _extra_size(name: str, v: Any) -> int:
    """Encoded size of one scalar; ValueError naming the entry when it is not an allowed type."""
    if isinstance(v, str):
        return len(v.encode("utf-8", "surrogatepass"))
    if isinstance(v, (bytes, bytearray, memoryview)):
        return len(v)
    if isinstance(v, bool):
        return 1
    if _is_int(v):
        if not -_I64 <= v < _I64:
            raise _fail(name, "integers must fit in 64 bits", v)
        return 8
    if isinstance(v, float):
        return 8
    raise _fail(name, "values must be str, bytes, int, float, bool or a list of those", type(v).__name__)


def check_extra(extra: Any) -> Mapping[str, ExtraValue]:
    """The validated, read-only copy of an `extra` mapping (lists become tuples, bytes-likes bytes)."""
    if not isinstance(extra, Mapping):
        raise _fail("extra", "must be a mapping of str to values", type(extra).__name__)
    if len(extra) > MAX_EXTRA_ENTRIES:
        raise _fail("extra", f"at most {MAX_EXTRA_ENTRIES} entries", len(extra))
    out: dict[str, ExtraValue] = {}
    total = 0
    for key, value in extra.items():
        if not isinstance(key, str) or not EXTRA_KEY.match(key):
            raise _fail("extra", f"keys must match {EXTRA_KEY.pattern}", key)
        name = f"extra[{key!r}]"
        if isinstance(value, (list, tuple)):
            if len(value) > MAX_EXTRA_LIST_ITEMS:
                raise _fail(name, f"lists hold at most {MAX_EXTRA_LIST_ITEMS} items", len(value))
            size = sum(_extra_size(name, v) for v in value)
            value = tuple(bytes(v) if isinstance(v, (bytearray, memoryview)) else v for v in value)
        else:
            size = _extra_size(name, value)
            if isinstance(value, (bytearray, memoryview)):
                value = bytes(value)
        if size > MAX_EXTRA_VALUE_BYTES:
            raise _fail(name, f"at most {MAX_EXTRA_VALUE_BYTES} bytes", f"{size} bytes")
        total += size + len(key)
        out[key] = value
    if total > MAX_EXTRA_BYTES:
        raise _fail("extra", f"at most {MAX_EXTRA_BYTES} bytes in all", f"{total} bytes")
    return MappingProxyType(out)


@dataclass(frozen=True)
class KVTransferParams:
    """The hand-off between the legs of a disaggregated request (see the module docstring)."""

    # Which leg: router -> prefill leg sets do_remote_decode; the decode leg do_remote_prefill.
    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    connector: str = ""  # the connector that produced the params ("p2p", "store", a plugin's name)
    request_id: str = ""  # the request the hand-off is bound to (the producer's request id)
    transfer_id: str = ""  # unique per hand-off, bound to request_id
    # Who holds the KV, and which incarnation of it.
    producer_id: str = ""
    producer_rank: int = 0
    producer_tp_size: int = 0  # 0: not stated (one rank)
    engine_epoch: int = 0
    # What to read.
    block_ids: tuple[int, ...] = ()  # the producer's blocks, in prompt order
    store_keys: tuple[str, ...] = ()  # object keys in a KV store, in prompt order
    block_hashes: tuple[bytes, ...] = ()  # chained hashes of the prompt's full blocks
    num_tokens: int = 0  # prompt tokens the KV covers
    block_size: int = 0
    # Where, and for how long.
    remote_host: str = ""
    remote_port: int = 0
    handshake_endpoint: str = ""
    producer_public_key: bytes = b""
    lease_id: str = ""
    lease_expiry_time: float = 0.0  # Unix seconds
    transfer_token: bytes = b""
    extra: Mapping[str, ExtraValue] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        for name in ("do_remote_decode", "do_remote_prefill"):
            if not isinstance(getattr(self, name), bool):
                raise _fail(name, "must be a bool", getattr(self, name))
        for name in ("connector", "request_id", "transfer_id", "producer_id", "remote_host",
                     "handshake_endpoint", "lease_id"):
            _check_str(name, getattr(self, name))
        for name in ("producer_rank", "producer_tp_size", "num_tokens", "block_size", "remote_port"):
            _check_int(name, getattr(self, name), _U32)
        _check_int("engine_epoch", self.engine_epoch, _U64)
        t = self.lease_expiry_time
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise _fail("lease_expiry_time", "must be a finite non-negative number of seconds", t)
        set_(self, "lease_expiry_time", float(t))
        ids = _as_seq("block_ids", self.block_ids)
        if not all(_is_int(b) and 0 <= b <= _U32 for b in ids):
            raise _fail("block_ids", f"must be integers in [0, {_U32}]", ids[:8])
        set_(self, "block_ids", ids)
        keys = _as_seq("store_keys", self.store_keys)
        for k in keys:
            _check_str("store_keys", k)
        set_(self, "store_keys", keys)
        set_(self, "block_hashes", tuple(_as_bytes("block_hashes", h) for h in _as_seq("block_hashes", self.block_hashes)))
        set_(self, "producer_public_key", _as_bytes("producer_public_key", self.producer_public_key))
        set_(self, "transfer_token", _as_bytes("transfer_token", self.transfer_token))
        set_(self, "extra", check_extra(self.extra))

    def replace(self, **changes: Any) -> KVTransferParams:
        """A copy with `changes` (validated like a new value)."""
        return dataclasses.replace(self, **changes)

    def for_decode_leg(self) -> KVTransferParams:
        """What the router sends the decode leg: these params, marked as a remote prefill."""
        return self.replace(do_remote_prefill=True, do_remote_decode=False)

    def to_wire(self) -> dict[str, Any]:
        """The fields that differ from their defaults, as plain msgpack-able data."""
        out: dict[str, Any] = {}
        for f in _FIELDS:
            value = getattr(self, f.name)
            if value == _DEFAULTS[f.name]:
                continue
            if f.name == "extra":
                value = {k: list(v) if isinstance(v, tuple) else v for k, v in value.items()}
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> KVTransferParams:
        """Inverse of to_wire(); ValueError naming any unknown or malformed field."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{_WHERE}: must be a mapping, got {type(data).__name__}")
        unknown = sorted(str(k) for k in data if k not in _DEFAULTS)
        if unknown:
            raise ValueError(f"{_WHERE}: unknown field(s) {', '.join(map(repr, unknown))} "
                             "(a connector's own values belong in extra)")
        return cls(**data)


_FIELDS = dataclasses.fields(KVTransferParams)
_DEFAULTS: dict[str, Any] = {f.name: getattr(KVTransferParams(), f.name) for f in _FIELDS}

__all__ = ["ExtraScalar", "ExtraValue", "KVTransferParams", "check_extra"]
