"""Schema-checked msgpack control messages, and optional HMAC-signed envelopes.

Wire form of a message (a msgpack map, nothing else):

    {"type": "kv_event_batch", "v": 1, "body": {field: value, ...}}

`decode` checks the byte size BEFORE unpacking, unpacks with every msgpack limit set (no ext
types, bounded str/bin/array/map lengths, str/bytes map keys only), then checks the envelope and
every body field against the schema registered for its type: unknown type or version, missing or
extra field, wrong type, value or length out of bounds, non-finite float. Every failure raises
the one error type `MalformedMessage` with a reason; the caller drops the message (and counts
it) and keeps serving everybody else.

Signed envelopes, for planes without CURVE (CURVE already authenticates and encrypts):

    msgpack [MAGIC, nonce(16 bytes), timestamp_ms, payload(bytes), hmac_sha256(32 bytes)]

The MAC covers magic, nonce, timestamp and payload. `ReplayGuard` rejects a timestamp outside
+-window and a nonce seen within the window; nonces are remembered only after the MAC checks
out, so only key holders can fill the guard.
"""

from __future__ import annotations

import copy
import hashlib
import hmac
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

ENVELOPE_KEYS = frozenset({"type", "v", "body"})
DEFAULT_MAX_SIZE = 1 << 20


class MalformedMessage(ValueError):
    """The one error for every bad input: garbage, oversize, wrong schema, bad MAC, replay."""


# -- schemas ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Field:
    """One field: allowed python types (bool is never taken for int unless listed), whether it
    must be present, bounds (value range for int/float, length range for str/bytes/list/dict;
    None = unbounded on that side), allowed values, and the spec of list items / dict values."""

    types: type | tuple[type, ...]
    required: bool = True
    bounds: tuple[float | None, float | None] | None = None
    choices: frozenset[Any] | None = None
    items: Field | MessageSchema | None = None
    default: Any = None  # filled in by decode when an optional field is absent

    def __post_init__(self) -> None:
        types = self.types if isinstance(self.types, tuple) else (self.types,)
        object.__setattr__(self, "types", tuple(type(None) if t is None else t for t in types))
        if self.choices is not None:
            object.__setattr__(self, "choices", frozenset(self.choices))


# A field spec can be written as a tuple (types, required, bounds) for brevity.
FieldSpec = Field | tuple


def _as_field(spec: FieldSpec) -> Field:
    if isinstance(spec, Field):
        return spec
    if isinstance(spec, tuple) and 1 <= len(spec) <= 3:
        return Field(*spec)
    raise TypeError(f"field spec must be Field or (types, required, bounds), got {spec!r}")


@dataclass(frozen=True)
class MessageSchema:
    type_name: str
    version: int
    fields: Mapping[str, FieldSpec] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "fields", {k: _as_field(v) for k, v in self.fields.items()})


SchemaRegistry = Mapping[str, MessageSchema]


def schema_registry(*schemas: MessageSchema) -> dict[str, MessageSchema]:
    out: dict[str, MessageSchema] = {}
    for s in schemas:
        if s.type_name in out:
            raise ValueError(f"two schemas for message type {s.type_name!r}")
        out[s.type_name] = s
    return out


def _type_name(types: tuple[type, ...]) -> str:
    return "|".join("None" if t is type(None) else t.__name__ for t in types)


def _check_value(path: str, spec: Field, value: Any, encoding: bool) -> Any:
    types = spec.types
    if isinstance(value, tuple) and list in types:
        value = list(value)  # senders may hand tuples; the wire has one array type
    if isinstance(value, bool) and bool not in types:
        raise MalformedMessage(f"{path}: expected {_type_name(types)}, got bool")
    if isinstance(value, int) and not isinstance(value, bool) and int not in types and float in types:
        value = float(value)  # an int where a float is expected: msgpack packs 2.0 and 2 alike
    if not isinstance(value, types):
        raise MalformedMessage(f"{path}: expected {_type_name(types)}, got {type(value).__name__}")
    if value is None:
        return value
    if isinstance(value, float) and not math.isfinite(value):
        raise MalformedMessage(f"{path}: must be finite, got {value}")
    if spec.choices is not None and not _is_choice(value, spec.choices):
        raise MalformedMessage(f"{path}: {value!r} is not one of {sorted(spec.choices, key=repr)}")
    if spec.bounds is not None:
        lo, hi = spec.bounds
        measure = value if isinstance(value, (int, float)) else len(value)
        what = "value" if isinstance(value, (int, float)) else "length"
        if (lo is not None and measure < lo) or (hi is not None and measure > hi):
            raise MalformedMessage(f"{path}: {what} {measure} outside [{lo}, {hi}]")
    if spec.items is not None and isinstance(value, list):
        return [_check_item(f"{path}[{i}]", spec.items, v, encoding) for i, v in enumerate(value)]
    if spec.items is not None and isinstance(value, dict):
        for k in value:
            if not isinstance(k, str):
                raise MalformedMessage(f"{path}: keys must be strings")
        return {k: _check_item(f"{path}[{k!r}]", spec.items, v, encoding) for k, v in value.items()}
    return value


def _is_choice(value: Any, choices: frozenset[Any]) -> bool:
    try:
        return value in choices
    except TypeError:  # unhashable (a list or map where a scalar was expected)
        return False


def _check_item(path: str, spec: Field | MessageSchema, value: Any, encoding: bool) -> Any:
    if isinstance(spec, MessageSchema):
        return _check_fields(path, spec, value, encoding)
    return _check_value(path, spec, value, encoding)


def _check_fields(path: str, schema: MessageSchema, body: Any, encoding: bool) -> dict[str, Any]:
    """Checked copy of body. Decoding fills absent optional fields with their default; encoding
    drops optional fields set to None instead (absent on the wire: older readers still decode)."""
    if not isinstance(body, dict):
        raise MalformedMessage(f"{path}: expected a map, got {type(body).__name__}")
    extra = [k for k in body if k not in schema.fields]
    if extra:
        shown = sorted(repr(k)[:40] for k in extra)[:5]
        raise MalformedMessage(f"{path}: unknown field(s) {shown}{' ...' if len(extra) > 5 else ''}")
    out: dict[str, Any] = {}
    for name, spec in schema.fields.items():
        assert isinstance(spec, Field)
        absent = name not in body or (encoding and body[name] is None and not spec.required)
        if not absent:
            out[name] = _check_value(f"{path}.{name}", spec, body[name], encoding)
        elif spec.required:
            raise MalformedMessage(f"{path}: missing required field {name!r}")
        elif not encoding:
            # a fresh copy: callers may mutate what decode returns
            out[name] = copy.copy(spec.default)
    return out


# -- encode / decode --------------------------------------------------------------------------
def encode(schema: MessageSchema, body: Mapping[str, Any], max_size: int | None = None) -> bytes:
    """Check body against schema (catches sender bugs early) and pack it. Optional fields whose
    value is None are left out, so a reader with an older schema that lacks them still decodes."""
    checked = _check_fields(schema.type_name, schema, dict(body), encoding=True)
    data = msgpack.packb({"type": schema.type_name, "v": schema.version, "body": checked}, use_bin_type=True)
    if max_size is not None and len(data) > max_size:
        raise MalformedMessage(f"{schema.type_name}: encoded size {len(data)} exceeds {max_size} bytes")
    return data


def _no_ext(code: int, data: bytes) -> Any:
    # max_ext_len=0 already refuses ext payloads; this also refuses zero-length ext values,
    # which would otherwise come back as msgpack.ExtType objects.
    raise MalformedMessage(f"msgpack ext type {code} is not allowed")


def unpack_bounded(data: bytes, max_size: int) -> Any:
    """msgpack.unpackb with the size checked first and every length bounded; MalformedMessage
    on any failure (garbage, truncation, trailing bytes, nesting too deep, ext types)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MalformedMessage(f"expected bytes, got {type(data).__name__}")
    if len(data) > max_size:
        raise MalformedMessage(f"message of {len(data)} bytes exceeds the {max_size}-byte limit")
    if len(data) == 0:
        raise MalformedMessage("empty message")
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_ext_len=0,
            max_bin_len=max_size,
            max_str_len=max_size,
            max_array_len=max_size,
            max_map_len=max_size,
            ext_hook=_no_ext,
        )
    except MalformedMessage:
        raise
    except Exception as e:  # msgpack raises many types (ValueError, ExtraData, StackError, ...)
        detail = f": {e}" if str(e) else ""
        raise MalformedMessage(f"not a valid msgpack message ({type(e).__name__}{detail})") from None


def decode(registry: SchemaRegistry, data: bytes, max_size: int = DEFAULT_MAX_SIZE) -> tuple[str, dict[str, Any]]:
    """(type_name, body) of a message made by `encode`; MalformedMessage for anything else.
    Absent optional fields are present in body with their default."""
    msg = unpack_bounded(data, max_size)
    if not isinstance(msg, dict) or set(msg) != ENVELOPE_KEYS:
        raise MalformedMessage("not a message envelope: expected a map with keys type, v, body")
    type_name, version = msg["type"], msg["v"]
    if not isinstance(type_name, str) or type_name not in registry:
        raise MalformedMessage(f"unknown message type {str(type_name)[:64]!r}")
    schema = registry[type_name]
    if isinstance(version, bool) or not isinstance(version, int):
        raise MalformedMessage(f"{type_name}: version must be an integer")
    if version != schema.version:
        raise MalformedMessage(f"{type_name}: unsupported version {version} (expected {schema.version})")
    return type_name, _check_fields(type_name, schema, msg["body"], encoding=False)


# -- signed envelopes -------------------------------------------------------------------------
SIGNED_MAGIC = "pdcluster-signed-v1"
NONCE_LEN = 16
MAC_LEN = 32
MIN_KEY_LEN = 32


def new_shared_key() -> bytes:
    return secrets.token_bytes(MIN_KEY_LEN)


def _mac(key: bytes, nonce: bytes, ts_ms: int, payload: bytes) -> bytes:
    signed = msgpack.packb([SIGNED_MAGIC, nonce, ts_ms, payload], use_bin_type=True)
    return hmac.new(key, signed, hashlib.sha256).digest()


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes) or len(key) < MIN_KEY_LEN:
        raise ValueError(f"shared key must be at least {MIN_KEY_LEN} random bytes")


class ReplayGuard:
    """Remembers nonces for `window_s`; rejects stale/future timestamps and repeated nonces.

    Bounded: at most max_entries nonces. When full (only possible with that much authentic
    traffic inside one window) new messages are refused rather than forgetting nonces early,
    which would reopen the replay hole."""

    def __init__(self, window_s: float = 30.0, max_entries: int = 100_000, clock: Callable[[], float] = time.time):
        self.window_ms = int(window_s * 1000)
        self.max_entries = max_entries
        self._clock = clock
        self._seen: OrderedDict[bytes, int] = OrderedDict()  # nonce -> expiry (ms), in arrival order

    def now_ms(self) -> int:
        return int(self._clock() * 1000)

    def check_and_remember(self, nonce: bytes, ts_ms: int) -> None:
        now = self.now_ms()
        # Arrival order is not expiry order when clocks differ, so expire by scanning the old
        # end until an unexpired entry; a late straggler only delays cleanup, never correctness.
        while self._seen:
            oldest, expiry = next(iter(self._seen.items()))
            if expiry > now:
                break
            del self._seen[oldest]
        if abs(now - ts_ms) > self.window_ms:
            raise MalformedMessage(f"signed message timestamp is {(now - ts_ms) / 1000:.1f}s off (window {self.window_ms / 1000}s)")
        if nonce in self._seen:
            raise MalformedMessage("replayed message (nonce already seen)")
        if len(self._seen) >= self.max_entries:
            raise MalformedMessage("replay cache full; message refused")
        self._seen[nonce] = max(now, ts_ms) + self.window_ms


def sign(key: bytes, payload: bytes, *, clock: Callable[[], float] = time.time) -> bytes:
    """Wrap payload (e.g. the output of `encode`) in an authenticated, replay-protected envelope."""
    _check_key(key)
    nonce = secrets.token_bytes(NONCE_LEN)
    ts_ms = int(clock() * 1000)
    mac = _mac(key, nonce, ts_ms, payload)
    return msgpack.packb([SIGNED_MAGIC, nonce, ts_ms, payload, mac], use_bin_type=True)


def verify(
    keys: bytes | Iterable[bytes],
    data: bytes,
    guard: ReplayGuard,
    max_size: int = DEFAULT_MAX_SIZE,
) -> bytes:
    """The payload of a signed envelope after checking its MAC (against any of `keys`, so a key
    can be rotated without downtime) and its freshness. MalformedMessage on any failure."""
    key_list = [keys] if isinstance(keys, bytes) else list(keys)
    for k in key_list:
        _check_key(k)
    msg = unpack_bounded(data, max_size)
    if not (isinstance(msg, list) and len(msg) == 5 and msg[0] == SIGNED_MAGIC):
        raise MalformedMessage("not a signed envelope")
    _, nonce, ts_ms, payload, mac = msg
    if not (isinstance(nonce, bytes) and len(nonce) == NONCE_LEN):
        raise MalformedMessage("signed envelope: bad nonce")
    if isinstance(ts_ms, bool) or not isinstance(ts_ms, int):
        raise MalformedMessage("signed envelope: bad timestamp")
    if not isinstance(payload, bytes) or not (isinstance(mac, bytes) and len(mac) == MAC_LEN):
        raise MalformedMessage("signed envelope: bad payload or MAC field")
    if not any(hmac.compare_digest(_mac(k, nonce, ts_ms, payload), mac) for k in key_list):
        raise MalformedMessage("signed envelope: MAC does not verify")
    guard.check_and_remember(nonce, ts_ms)
    return payload


class RefusedRequest(Exception):
    """open_request's refusal: the error reply's nonce (b"" before one was read) and reason."""

    def __init__(self, nonce: bytes, reason: str, message: str) -> None:
        super().__init__(message)
        self.nonce, self.reason = nonce, reason


def open_request(frames: list[bytes], registry: SchemaRegistry, max_size: int, guard: ReplayGuard,
                 lock: Any) -> tuple[str, dict[str, Any], bytes]:
    """(kind, body, nonce) of one control-plane request: exactly one frame, a valid envelope of
    `registry`, a nonce + timestamp `guard` (held under `lock`) has not seen. RefusedRequest with
    reason "malformed" or "replayed" otherwise (the connectors' control ports share this)."""
    if len(frames) != 1:
        raise RefusedRequest(b"", "malformed", f"expected one frame, got {len(frames)}")
    try:
        kind, body = decode(registry, frames[0], max_size)
    except MalformedMessage as e:
        raise RefusedRequest(b"", "malformed", f"malformed message: {e}") from None
    nonce = body["nonce"]
    try:
        with lock:
            guard.check_and_remember(nonce, body["ts_ms"])
    except MalformedMessage as e:
        raise RefusedRequest(nonce, "replayed", str(e)) from None
    return kind, body, nonce
