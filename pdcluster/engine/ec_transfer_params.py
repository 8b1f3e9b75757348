"""ECTransferParams: where another instance holds encoder outputs for a request, typed.

The encoder-cache (EC) hand-off, the EC counterpart of KVTransferParams. A producer (an encode
worker, or a prefill worker that encoded an image) builds one when it has saved encoder outputs and
holds them under a lease; it travels producer engine -> worker (proto EcTransferParams,
pdcluster.proto_convert) -> router -> the consumer legs -> their engines, whose EC connector fetches
each item by mm_hash and encodes locally when the fetch fails.

Every field is checked when the value is built, so a malformed hand-off fails where it enters with
the field named. Sizes are bounded: a request carries at most MAX_EC_PRODUCERS of these and each at
most MAX_EC_ITEMS items.

    to_wire() / from_wire()   plain msgpack-able dict <-> the value; unknown fields refused by name
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

MAX_EC_ITEMS = 256  # items in one params value (distinct images of one request, at most)
MAX_EC_PRODUCERS = 16  # params values one request carries
MAX_STR = 1024
MAX_KEY_BYTES = 64  # a CURVE public key is 32 bytes (40 in Z85)
_U32, _U64 = (1 << 32) - 1, (1 << 64) - 1
MM_HASH = re.compile(r"^[0-9a-f]{64}$")
_WHERE = "ec_transfer_params"


def _fail(name: str, what: str, value: Any) -> ValueError:
    return ValueError(f"{_WHERE}.{name}: {what}, got {str(value)[:80]!r}")


def _int(name: str, v: Any, top: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= top:
        raise _fail(name, f"must be an integer in [0, {top}]", v)


def _str(name: str, v: Any) -> None:
    if not isinstance(v, str) or len(v) > MAX_STR:
        raise _fail(name, f"must be a string of at most {MAX_STR} characters", v)


@dataclass(frozen=True)
class ECItemRef:
    """One encoder output the producer holds: which image, under which lease, how big."""

    mm_hash: str
    lease_id: str = ""
    nbytes: int = 0
    num_tokens: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.mm_hash, str) or not MM_HASH.match(self.mm_hash):
            raise _fail("items.mm_hash", "must be 64 lowercase hex characters (sha256)", self.mm_hash)
        _str("items.lease_id", self.lease_id)
        _int("items.nbytes", self.nbytes, _U64)
        _int("items.num_tokens", self.num_tokens, _U32)


@dataclass(frozen=True)
class ECTransferParams:
    """The items one producer holds for a request (see the module docstring)."""

    connector: str = ""
    producer_id: str = ""
    address: str = ""  # host:port of the producer's EC control endpoint
    public_key: bytes = b""  # the producer's CURVE server key
    fingerprint: str = ""  # encoder compatibility fingerprint
    engine_epoch: int = 0
    expires_at: float = 0.0  # Unix time
    items: tuple[ECItemRef, ...] = ()

    def __post_init__(self) -> None:
        for name in ("connector", "producer_id", "address", "fingerprint"):
            _str(name, getattr(self, name))
        key = self.public_key
        if not isinstance(key, (bytes, bytearray, memoryview)) or len(key) > MAX_KEY_BYTES:
            raise _fail("public_key", f"must be at most {MAX_KEY_BYTES} bytes", key)
        object.__setattr__(self, "public_key", bytes(key))
        _int("engine_epoch", self.engine_epoch, _U64)
        if isinstance(self.expires_at, bool) or not isinstance(self.expires_at, (int, float)) \
                or not math.isfinite(self.expires_at) or self.expires_at < 0:
            raise _fail("expires_at", "must be a finite, non-negative Unix time", self.expires_at)
        object.__setattr__(self, "expires_at", float(self.expires_at))
        items = self.items
        if not isinstance(items, (list, tuple)) or len(items) > MAX_EC_ITEMS:
            raise _fail("items", f"must be a list of at most {MAX_EC_ITEMS} items", items)
        items = tuple(i if isinstance(i, ECItemRef) else _item_from_wire(i) for i in items)
        if len({i.mm_hash for i in items}) != len(items):
            raise _fail("items", "each mm_hash at most once", [i.mm_hash[:12] for i in items])
        object.__setattr__(self, "items", items)

    def item(self, mm_hash: str) -> ECItemRef | None:
        return next((i for i in self.items if i.mm_hash == mm_hash), None)

    def to_wire(self) -> dict[str, Any]:
        """The non-default fields as plain data (items as a list of dicts)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "items":
                if value:
                    out["items"] = [{k: v for k, v in dataclasses.asdict(i).items() if v or k == "mm_hash"}
                                    for i in value]
            elif value != f.default:
                out[f.name] = value
        return out

    @classmethod
    def from_wire(cls, data: Any) -> ECTransferParams:
        if not isinstance(data, dict):
            raise _fail("", "must be a mapping", type(data).__name__)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in data if k not in known)
        if unknown:
            raise _fail(unknown[0], "is not a field", unknown)
        kwargs = dict(data)
        if "items" in kwargs:
            raw = kwargs["items"]
            if not isinstance(raw, (list, tuple)) or len(raw) > MAX_EC_ITEMS:
                raise _fail("items", f"must be a list of at most {MAX_EC_ITEMS} items", raw)
            kwargs["items"] = tuple(_item_from_wire(i) for i in raw)
        return cls(**kwargs)


def _item_from_wire(data: Any) -> ECItemRef:
    if not isinstance(data, dict):
        raise _fail("items", "each item must be a mapping", type(data).__name__)
    known = {f.name for f in dataclasses.fields(ECItemRef)}
    unknown = sorted(str(k) for k in data if k not in known)
    if unknown:
        raise _fail(f"items.{unknown[0]}", "is not a field", unknown)
    if "mm_hash" not in data:
        raise _fail("items.mm_hash", "is required", data)
    return ECItemRef(**data)


def check_ec_params_list(params: Any) -> tuple[ECTransferParams, ...]:
    """The params values of one request (at most MAX_EC_PRODUCERS), validated."""
    if not isinstance(params, (list, tuple)) or len(params) > MAX_EC_PRODUCERS:
        raise _fail("", f"a request carries at most {MAX_EC_PRODUCERS} of them", params)
    return tuple(p if isinstance(p, ECTransferParams) else ECTransferParams.from_wire(p) for p in params)


__all__ = ["ECItemRef", "ECTransferParams", "MAX_EC_ITEMS", "MAX_EC_PRODUCERS", "check_ec_params_list"]
