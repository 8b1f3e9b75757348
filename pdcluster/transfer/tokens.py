"""Capability tokens for the bulk data plane: stateless HMAC-SHA256 grants.

A token lets its holder perform ONE operation (READ or WRITE) on EXACTLY the listed byte ranges
of ONE registered region of ONE transfer server, until an expiry. The issuer (the control plane:
the kvstore master, or a P2P producer) and the transfer server share a secret key; the server
verifies a token with that key and its clock alone -- no lookup, no state, no round trip.

Wire form (fixed size, 104 bytes, network byte order):

    +---------+----+----------+-------------+-----------+-----------+---------------+--------+
    | version | op | reserved | serial | transfer_id | region_id | expiry_ms | ranges_digest |  mac   |
    |   u8    | u8 |   u16    |  u32   |   16 bytes  |    u64    |    u64    |   32 bytes    | 32 B   |
    +---------+----+----------+-------------+-----------+-----------+---------------+--------+
    mac = HMAC-SHA256(key, every byte before it)

`ranges_digest` = SHA-256 over the (offset, length) pairs, so a token for ranges A is useless
for ranges B even on the same region.

`serial` (0 unless the issuer sets it) makes two grants of the same claims distinct tokens, so
a server that enforces single use (single_use.py) tells them apart.

Replay: by default a token may be presented any number of times until `expiry_ms` (several
parallel streams of one transfer present the same token). It is refused after expiry. Issuers
therefore keep lifetimes short and never reuse the bytes a token covers before it has expired
plus a clock-skew grace (the kvstore master quarantines freed space for exactly that reason).
A server built with `single_use=True` (the P2P producer) serves each byte of a token's
coverage once: a replayed window is refused and counted.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass

TOKEN_VERSION = 1
OP_READ = 1
OP_WRITE = 2
_CLAIMS = struct.Struct("!BBHI16sQQ32s")
MAC_LEN = 32
TOKEN_LEN = _CLAIMS.size + MAC_LEN  # 104
_RANGE = struct.Struct("!QQ")
MIN_KEY_LEN = 16


class TokenError(Exception):
    """A token is malformed, forged, expired or does not cover the request. `reason` is a metric label."""

    def __init__(self, reason: str, msg: str = "") -> None:
        super().__init__(msg or reason)
        self.reason = reason


@dataclass(frozen=True)
class Capability:
    transfer_id: bytes  # 16 bytes, unique per transfer
    op: int  # OP_READ or OP_WRITE
    region_id: int
    expiry_ms: int  # unix wall-clock milliseconds
    ranges_digest: bytes  # 32 bytes, see ranges_digest()
    serial: int = 0  # issuer-chosen u32 that tells apart two grants of the same claims


def ranges_digest(ranges: Sequence[tuple[int, int]]) -> bytes:
    # One C call over the joined bytes (the kvstore master mints a token per object per RPC).
    return hashlib.sha256(len(ranges).to_bytes(8, "big") + b"".join(_RANGE.pack(o, n) for o, n in ranges)).digest()


def derive_key(secret: bytes, label: str) -> bytes:
    """Domain-separated key (e.g. one per storage node or per use) from a cluster secret."""
    if len(secret) < MIN_KEY_LEN:
        raise ValueError(f"secret must be at least {MIN_KEY_LEN} bytes")
    return hmac.new(secret, b"pdcluster-transfer/" + label.encode(), hashlib.sha256).digest()


def now_ms() -> int:
    return int(time.time() * 1000)


def issue_token(key: bytes, transfer_id: bytes, op: int, region_id: int,
                ranges: Sequence[tuple[int, int]], ttl_s: float | None = None,
                expiry_ms: int | None = None, serial: int = 0) -> bytes:
    """Mint a token. Give either `ttl_s` (from now) or an absolute `expiry_ms`."""
    if len(key) < MIN_KEY_LEN:
        raise ValueError("key too short")
    if len(transfer_id) != 16:
        raise ValueError("transfer_id must be 16 bytes")
    if op not in (OP_READ, OP_WRITE):
        raise ValueError(f"bad op {op}")
    if expiry_ms is None:
        if ttl_s is None:
            raise ValueError("give ttl_s or expiry_ms")
        expiry_ms = now_ms() + int(ttl_s * 1000)
    if not 0 <= serial < 1 << 32:
        raise ValueError("serial must be a u32")
    claims = _CLAIMS.pack(TOKEN_VERSION, op, 0, serial, transfer_id, region_id, expiry_ms,
                          ranges_digest(ranges))
    return claims + hmac.digest(key, claims, "sha256")


def parse_token(token: bytes) -> Capability:
    """Decode claims WITHOUT verifying (for holders that want to read the expiry)."""
    if len(token) != TOKEN_LEN:
        raise TokenError("malformed", f"token must be {TOKEN_LEN} bytes, got {len(token)}")
    version, op, _reserved, serial, tid, region_id, expiry_ms, digest = _CLAIMS.unpack_from(token)
    if version != TOKEN_VERSION or op not in (OP_READ, OP_WRITE):
        raise TokenError("malformed", "unknown token version or op")
    return Capability(tid, op, region_id, expiry_ms, digest, serial)


def verify_token(key: bytes, token: bytes, *, now: int | None = None, skew_ms: int = 0) -> Capability:
    """Check the MAC (constant time) and expiry; return the claims. Raises TokenError."""
    cap = parse_token(token)
    mac = hmac.digest(key, bytes(token[:_CLAIMS.size]), "sha256")
    if not hmac.compare_digest(mac, bytes(token[_CLAIMS.size:])):
        raise TokenError("bad_mac", "token signature invalid")
    if (now_ms() if now is None else now) > cap.expiry_ms + skew_ms:
        raise TokenError("expired", "token expired")
    return cap


def check_claims(cap: Capability, transfer_id: bytes, op: int, region_id: int) -> None:
    """The request's transfer, op and region must be the token's."""
    if cap.op != op:
        raise TokenError("wrong_op", "token is for another operation")
    if cap.transfer_id != transfer_id:
        raise TokenError("wrong_transfer", "token is for another transfer")
    if cap.region_id != region_id:
        raise TokenError("wrong_region", "token is for another region")


def check_ranges(cap: Capability, ranges: Sequence[tuple[int, int]]) -> None:
    """The request's range list must be exactly the token's."""
    if not hmac.compare_digest(cap.ranges_digest, ranges_digest(ranges)):
        raise TokenError("wrong_ranges", "token does not cover these ranges")


def table_digest(num_ranges: int, table: bytes | memoryview) -> bytes:
    """ranges_digest of a range table as it came off the wire (num_ranges x (u64, u64) big
    endian, the very bytes ranges_digest packs): one C call, no per-range Python."""
    return hashlib.sha256(num_ranges.to_bytes(8, "big") + bytes(table[:num_ranges * _RANGE.size])).digest()


def check_ranges_table(cap: Capability, num_ranges: int, table: bytes | memoryview) -> None:
    """check_ranges on the wire's range table."""
    if not hmac.compare_digest(cap.ranges_digest, table_digest(num_ranges, table)):
        raise TokenError("wrong_ranges", "token does not cover these ranges")
