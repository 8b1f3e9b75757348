from __future__ import annotations

import secrets

import pytest

from pdcluster.transfer import (
    OP_READ,
    OP_WRITE,
    TOKEN_LEN,
    TokenError,
    derive_key,
    issue_token,
    parse_token,
    verify_token,
)
from pdcluster.transfer.tokens import check_claims, check_ranges, now_ms

KEY = secrets.token_bytes(32)
TID = secrets.token_bytes(16)
RANGES = [(0, 4096), (8192, 100)]


def test_roundtrip_and_claims() -> None:
    tok = issue_token(KEY, TID, OP_READ, 7, RANGES, ttl_s=5)
    assert len(tok) == TOKEN_LEN
    cap = verify_token(KEY, tok)
    assert (cap.transfer_id, cap.op, cap.region_id) == (TID, OP_READ, 7)
    check_claims(cap, TID, OP_READ, 7)
    check_ranges(cap, RANGES)


@pytest.mark.parametrize("byte", [0, 1, 5, 20, 40, 70, 103])
def test_any_flipped_byte_is_refused(byte: int) -> None:
    tok = bytearray(issue_token(KEY, TID, OP_READ, 7, RANGES, ttl_s=5))
    tok[byte] ^= 0x01
    with pytest.raises(TokenError):
        verify_token(KEY, bytes(tok))


def test_wrong_key_expired_and_malformed() -> None:
    tok = issue_token(KEY, TID, OP_WRITE, 1, RANGES, ttl_s=5)
    with pytest.raises(TokenError) as e:
        verify_token(secrets.token_bytes(32), tok)
    assert e.value.reason == "bad_mac"
    old = issue_token(KEY, TID, OP_WRITE, 1, RANGES, expiry_ms=now_ms() - 1)
    with pytest.raises(TokenError) as e:
        verify_token(KEY, old)
    assert e.value.reason == "expired"
    verify_token(KEY, old, skew_ms=60_000)  # tolerated skew
    for bad in (b"", b"x" * 50, tok + b"\0"):
        with pytest.raises(TokenError) as e:
            parse_token(bad)
        assert e.value.reason == "malformed"


def test_claims_mismatch_reasons() -> None:
    cap = verify_token(KEY, issue_token(KEY, TID, OP_READ, 3, RANGES, ttl_s=5))
    cases = [((TID, OP_WRITE, 3), "wrong_op"), ((secrets.token_bytes(16), OP_READ, 3), "wrong_transfer"),
             ((TID, OP_READ, 4), "wrong_region")]
    for args, reason in cases:
        with pytest.raises(TokenError) as e:
            check_claims(cap, *args)
        assert e.value.reason == reason
    for other in ([(0, 4096)], [(0, 4096), (8192, 101)], list(reversed(RANGES))):
        with pytest.raises(TokenError) as e:
            check_ranges(cap, other)
        assert e.value.reason == "wrong_ranges"


def test_derive_key_is_domain_separated() -> None:
    a, b = derive_key(KEY, "node/a"), derive_key(KEY, "node/b")
    assert a != b and len(a) == 32 and derive_key(KEY, "node/a") == a
    with pytest.raises(ValueError):
        derive_key(b"short", "x")
