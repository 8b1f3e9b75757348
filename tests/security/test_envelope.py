"""Envelopes: every malformed input is one MalformedMessage; valid messages round-trip."""

from __future__ import annotations

import random

import msgpack
import pytest

from pdcluster.security.envelope import (
    Field,
    MalformedMessage,
    MessageSchema,
    ReplayGuard,
    decode,
    encode,
    new_shared_key,
    schema_registry,
    sign,
    unpack_bounded,
    verify,
)

ITEM = MessageSchema("item", 1, {"id": (int, True, (0, 100)), "tag": Field(str, False, (1, 8))})
PING = MessageSchema(
    "ping",
    2,
    {
        "seq": (int, True, (0, 2**63 - 1)),
        "name": (str, True, (1, 16)),
        "ratio": Field(float, False, (0.0, 1.0), default=0.5),
        "flag": Field(bool, False, default=False),
        "blob": Field(bytes, False, (0, 64)),
        "ids": Field(list, False, (0, 4), items=Field(int, bounds=(0, None))),
        "items": Field(list, False, (0, 3), items=ITEM),
        "extra": Field(dict, False, (0, 4), items=Field(str, bounds=(0, 32))),
        "mode": Field(str, False, choices={"a", "b"}),
        "maybe": Field((int, None), False),
    },
)
REG = schema_registry(PING, ITEM)
GOOD = {"seq": 7, "name": "w0", "ratio": 0.25, "flag": True, "blob": b"\x00\x01", "ids": [1, 2],
        "items": [{"id": 3}], "extra": {"k": "v"}, "mode": "a"}


def raw(type_name="ping", v=2, body=None) -> bytes:
    return msgpack.packb({"type": type_name, "v": v, "body": GOOD if body is None else body}, use_bin_type=True)


def test_roundtrip_fills_defaults():
    t, body = decode(REG, encode(PING, GOOD))
    assert t == "ping"
    assert body["items"] == [{"id": 3, "tag": None}]
    assert {k: body[k] for k in GOOD if k != "items"} == {k: v for k, v in GOOD.items() if k != "items"}
    t, body = decode(REG, encode(PING, {"seq": 1, "name": "x", "ratio": None, "ids": (4, 5)}))
    assert body == {"seq": 1, "name": "x", "ratio": 0.5, "flag": False, "blob": None, "ids": [4, 5],
                    "items": None, "extra": None, "mode": None, "maybe": None}


def test_int_accepted_for_float():
    _, body = decode(REG, raw(body={"seq": 1, "name": "x", "ratio": 1}))
    assert body["ratio"] == 1.0 and isinstance(body["ratio"], float)


BAD_BODIES = {
    "missing required": {"name": "x"},
    "extra field": {**GOOD, "evil": 1},
    "wrong type": {**GOOD, "seq": "7"},
    "bool for int": {**GOOD, "seq": True},
    "int below bound": {**GOOD, "seq": -1},
    "float above bound": {**GOOD, "ratio": 1.5},
    "nan": {**GOOD, "ratio": float("nan")},
    "inf": {**GOOD, "ratio": float("inf")},
    "string too long": {**GOOD, "name": "x" * 17},
    "empty string": {**GOOD, "name": ""},
    "bytes too long": {**GOOD, "blob": b"x" * 65},
    "str for bytes": {**GOOD, "blob": "ab"},
    "list too long": {**GOOD, "ids": [1, 2, 3, 4, 5]},
    "bad list item": {**GOOD, "ids": [1, -2]},
    "nested extra field": {**GOOD, "items": [{"id": 1, "zzz": 2}]},
    "nested bad type": {**GOOD, "items": [{"id": "1"}]},
    "nested not a map": {**GOOD, "items": [5]},
    "bad dict value": {**GOOD, "extra": {"k": 5}},
    "not a choice": {**GOOD, "mode": "c"},
    "body not a map": [1, 2, 3],
}


@pytest.mark.parametrize("case", sorted(BAD_BODIES))
def test_bad_bodies(case):
    with pytest.raises(MalformedMessage):
        decode(REG, raw(body=BAD_BODIES[case]))


@pytest.mark.parametrize("case", sorted(k for k, v in BAD_BODIES.items() if isinstance(v, dict)))
def test_encode_checks_too(case):
    body = BAD_BODIES[case]
    with pytest.raises(MalformedMessage):
        encode(PING, body)


BAD_ENVELOPES = {
    "empty": b"",
    "garbage": b"\xc1\xc1\xc1",
    "not a map": msgpack.packb([1, 2, 3]),
    "unknown type": raw(type_name="pong"),
    "type not str": raw(type_name=5),
    "wrong version": raw(v=1),
    "version bool": raw(v=True),
    "missing body": msgpack.packb({"type": "ping", "v": 2}),
    "extra envelope key": msgpack.packb({"type": "ping", "v": 2, "body": GOOD, "x": 1}, use_bin_type=True),
    "int map key": msgpack.packb({1: 2}),
    "bytes map key": msgpack.packb({b"type": "ping", b"v": 2, b"body": {}}, use_bin_type=True),
    "ext type": msgpack.packb({"type": "ping", "v": 2, "body": {"seq": msgpack.ExtType(1, b"abcd")}}),
    "zero-length ext": msgpack.packb(msgpack.ExtType(5, b"")),
    "timestamp ext": msgpack.packb({"type": "ping", "v": 2, "body": {"seq": msgpack.Timestamp(1, 0)}}),
    "trailing bytes": raw() + b"\x00",
    "deep nesting": b"\x91" * 100_000 + b"\x00",
}


@pytest.mark.parametrize("case", sorted(BAD_ENVELOPES))
def test_bad_envelopes(case):
    with pytest.raises(MalformedMessage):
        decode(REG, BAD_ENVELOPES[case], max_size=1 << 20)


def test_every_truncation_is_malformed():
    data = encode(PING, GOOD)
    for n in range(len(data)):
        with pytest.raises(MalformedMessage):
            decode(REG, data[:n])


def test_random_garbage_and_bit_flips_never_escape():
    rng = random.Random(0)
    data = bytearray(encode(PING, GOOD))
    for _ in range(500):
        blob = bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 64)))
        flipped = bytearray(data)
        flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
        for candidate in (blob, bytes(flipped)):
            try:
                decode(REG, candidate)
            except MalformedMessage:
                pass  # the only error allowed to escape


def test_size_checked_before_decoding(monkeypatch):
    data = encode(PING, GOOD)
    calls = []
    monkeypatch.setattr(msgpack, "unpackb", lambda *a, **k: calls.append(1))
    with pytest.raises(MalformedMessage, match="exceeds"):
        decode(REG, data, max_size=len(data) - 1)
    assert not calls
    with pytest.raises(MalformedMessage, match="exceeds"):
        encode(PING, GOOD, max_size=8)


def test_length_bounds_follow_max_size():
    big = msgpack.packb(["x" * 1000])
    assert unpack_bounded(big, 2000) == ["x" * 1000]
    with pytest.raises(MalformedMessage):
        unpack_bounded(b"\xdd\xff\xff\xff\xff", 100)  # array header claiming 4G items
    with pytest.raises(MalformedMessage):
        unpack_bounded(12345, 100)  # not bytes


def test_duplicate_schema_rejected():
    with pytest.raises(ValueError):
        schema_registry(PING, PING)


# -- signed envelopes -------------------------------------------------------------------------
class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_sign_verify_roundtrip_and_replay_rejected():
    key, clock = new_shared_key(), Clock()
    guard = ReplayGuard(window_s=30, clock=clock)
    payload = encode(PING, GOOD)
    signed = sign(key, payload, clock=clock)
    assert verify(key, signed, guard) == payload
    with pytest.raises(MalformedMessage, match="replay"):
        verify(key, signed, guard)
    assert verify(key, sign(key, payload, clock=clock), guard) == payload  # fresh nonce is fine


def test_tampering_wrong_key_and_garbage_rejected():
    key, clock = new_shared_key(), Clock()
    guard = ReplayGuard(clock=clock)
    signed = sign(key, b"payload", clock=clock)
    with pytest.raises(MalformedMessage, match="MAC"):
        verify(new_shared_key(), signed, guard)
    parts = msgpack.unpackb(signed)
    for i, bad in ((3, b"PAYLOAD"), (2, parts[2] + 1), (1, b"\x00" * 16)):
        forged = list(parts)
        forged[i] = bad
        with pytest.raises(MalformedMessage):
            verify(key, msgpack.packb(forged, use_bin_type=True), guard)
    for garbage in (b"", b"\xc1", msgpack.packb([1, 2]), msgpack.packb(["pdcluster-signed-v1", 1, 2, 3, 4])):
        with pytest.raises(MalformedMessage):
            verify(key, garbage, guard)
    # The failed attempts did not burn the genuine message's nonce.
    assert verify(key, signed, guard) == b"payload"


def test_timestamp_window_and_key_rotation():
    old_key, new_key = new_shared_key(), new_shared_key()
    clock = Clock()
    guard = ReplayGuard(window_s=10, clock=clock)
    stale = sign(old_key, b"x", clock=Clock(clock.t - 11))
    future = sign(old_key, b"x", clock=Clock(clock.t + 11))
    for data in (stale, future):
        with pytest.raises(MalformedMessage, match="off"):
            verify([old_key, new_key], data, guard)
    assert verify([new_key, old_key], sign(old_key, b"y", clock=clock), guard) == b"y"


def test_replay_guard_is_bounded_and_expires():
    key, clock = new_shared_key(), Clock()
    guard = ReplayGuard(window_s=1, max_entries=3, clock=clock)
    for _ in range(3):
        verify(key, sign(key, b"m", clock=clock), guard)
    with pytest.raises(MalformedMessage, match="full"):
        verify(key, sign(key, b"m", clock=clock), guard)
    clock.t += 2  # the window passes: old nonces expire, memory is reclaimed
    verify(key, sign(key, b"m", clock=clock), guard)
    assert len(guard._seen) == 1


def test_short_key_refused():
    with pytest.raises(ValueError):
        sign(b"short", b"x")
