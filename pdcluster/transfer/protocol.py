"""Data-plane wire format and zero-copy socket helpers.

One TCP connection carries a sequence of requests; every request frame carries its token, so the
first frame of every connection is authenticated and so is each later one.

    request  = REQ_HEADER (52 B) | token (104 B) | num_ranges x (offset u64, length u64)
               [ | client nonce (16 B): READ with FLAG_GMAC, see gmac.py ]
               [ | payload: the part's bytes, WRITE only ]
    response = RESP_HEADER (16 B) [ | server nonce (16 B): READ with FLAG_GMAC and status OK ]
                                  [ | payload: the part's bytes, READ with status OK ]
                                  [ | MAC (32 B): READ with FLAG_MAC, see integrity.py ]
                                  [ | tag (16 B): READ with FLAG_GMAC, see gmac.py ]

A server that predates FLAG_GMAC refuses it as bad_request (bad_flags) before it reads past the
header; the readers then ask that peer for FLAG_MAC instead (TransferClient.mac).

A transfer's bytes are the concatenation of its ranges (in order). A request serves the window
`[part_start, part_start + part_len)` of that concatenation, so a client can split one transfer
over several connections ("streams") that all present the same token and range list.

Every size field is checked against explicit bounds before anything is allocated.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence

from .tokens import TOKEN_LEN

PROTO_VERSION = 1
REQ_MAGIC = b"PDXQ"
RESP_MAGIC = b"PDXS"
REQ_HEADER = struct.Struct("!4sBBHIQQQ16s")  # magic, version, op, flags, num_ranges, region, start, len, tid
RESP_HEADER = struct.Struct("!4sBBHQ")  # magic, status, reserved, reserved, nbytes
RANGE = struct.Struct("!QQ")
REQ_FIXED_LEN = REQ_HEADER.size + TOKEN_LEN

DEFAULT_MAX_RANGES = 16384
DEFAULT_MAX_REQUEST_BYTES = 1 << 34  # 16 GiB per request window
_IOV_MAX = 512  # well under Linux's IOV_MAX (1024)

# Response status codes.
ST_OK = 0
ST_BAD_REQUEST = 1
ST_UNAUTHORIZED = 2
ST_EXPIRED = 3
ST_NO_REGION = 4
ST_OUT_OF_RANGE = 5
ST_TOO_LARGE = 6
ST_INTERNAL = 7
ST_REVOKED = 8  # the grant behind a valid token ended (e.g. its P2P lease was released)
ST_REPLAYED = 9  # a single-use server saw this part of the token already
STATUS_NAMES = {ST_OK: "ok", ST_BAD_REQUEST: "bad_request", ST_UNAUTHORIZED: "unauthorized",
                ST_EXPIRED: "expired", ST_NO_REGION: "no_region", ST_OUT_OF_RANGE: "out_of_range",
                ST_TOO_LARGE: "too_large", ST_INTERNAL: "internal", ST_REVOKED: "revoked",
                ST_REPLAYED: "replayed"}
TOKEN_STATUS = {"expired": ST_EXPIRED, "revoked": ST_REVOKED, "replayed": ST_REPLAYED}

# Request flags.
FLAG_MAC = 1  # READ only: append the window's keyed-BLAKE3 MAC after its bytes (integrity.py)
FLAG_GMAC = 2  # READ only: nonces both ways, AES-256-GMAC tag after the bytes (gmac.py)
MAC_FLAGS = (FLAG_MAC, FLAG_GMAC)


class ProtocolError(Exception):
    """Malformed or out-of-bounds frame; `status` is the code sent back (if any)."""

    def __init__(self, status: int, reason: str, msg: str = "") -> None:
        super().__init__(msg or reason)
        self.status = status
        self.reason = reason


def pack_request(op: int, region_id: int, transfer_id: bytes, token: bytes,
                 ranges: Sequence[tuple[int, int]], part_start: int, part_len: int, flags: int = 0) -> bytes:
    head = REQ_HEADER.pack(REQ_MAGIC, PROTO_VERSION, op, flags, len(ranges), region_id, part_start,
                           part_len, transfer_id)
    table = b"".join(RANGE.pack(o, n) for o, n in ranges)
    return head + token + table


def unpack_ranges(buf: memoryview | bytes, num_ranges: int) -> list[tuple[int, int]]:
    return [RANGE.unpack_from(buf, i * RANGE.size) for i in range(num_ranges)]


def window_segments(ranges: Sequence[tuple[int, int]], start: int, length: int) -> list[tuple[int, int]]:
    """Region (offset, length) pieces covering bytes [start, start+length) of the concatenated ranges.

        ranges:  |--r0--|----r1----|-r2-|        (concatenated)
        window:      [=========]
        pieces:      [r0 tail][r1 head]
    """
    out: list[tuple[int, int]] = []
    pos = 0
    end = start + length
    for off, n in ranges:
        lo, hi = max(start, pos), min(end, pos + n)
        if lo < hi:
            out.append((off + lo - pos, hi - lo))
        pos += n
        if pos >= end:
            break
    return out


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` completely straight from the socket (no intermediate buffer).

    On a blocking socket (no Python-level timeout; the client's sockets carry SO_RCVTIMEO
    instead, see blocking_with_os_timeouts) MSG_WAITALL lets the kernel fill the whole view in
    one call instead of one recv per segment, each preceded by a poll()."""
    got, total = 0, view.nbytes
    flags = socket.MSG_WAITALL if sock.gettimeout() is None else 0
    while got < total:
        n = sock.recv_into(view[got:], total - got, flags)
        if n == 0:
            raise ConnectionError("peer closed the connection")
        got += n


def _advance(pending: list[memoryview], done: int) -> list[memoryview]:
    """The views still to fill or send after `done` more bytes: the whole ones dropped, the
    partly done one trimmed."""
    i = 0
    while i < len(pending) and done >= pending[i].nbytes:
        done -= pending[i].nbytes
        i += 1
    rest = pending[i:]
    if done:
        rest[0] = rest[0][done:]
    return rest


def recv_views(sock: socket.socket, views: Sequence[memoryview]) -> None:
    """Fill every view completely, in order, with as few syscalls as the kernel allows: one
    recvmsg_into (readv) over up to _IOV_MAX views with MSG_WAITALL on a blocking socket, where
    recv_exact would take one call per view (a 128 MiB read of 64 KiB blocks: 2,048 calls)."""
    pending = [v for v in views if v.nbytes]
    flags = socket.MSG_WAITALL if sock.gettimeout() is None else 0
    while pending:
        batch = pending[:_IOV_MAX]
        got = sock.recvmsg_into(batch, 0, flags)[0]
        if got == 0:
            raise ConnectionError("peer closed the connection")
        pending = _advance(pending, got)


def send_views(sock: socket.socket, views: Sequence[memoryview | bytes]) -> None:
    """Gather-send every view without concatenating them (sendmsg, handling partial sends)."""
    pending = [v if isinstance(v, memoryview) else memoryview(v) for v in views if len(v)]
    while pending:
        batch = pending[:_IOV_MAX]
        pending = _advance(pending, sock.sendmsg(batch))


def blocking_with_os_timeouts(sock: socket.socket, timeout_s: float) -> None:
    """Make `sock` blocking with the I/O timeout enforced by the kernel (SO_RCVTIMEO/SO_SNDTIMEO)
    rather than by Python, which polls before every recv/send: half the syscalls per segment.
    A timeout then raises OSError (EAGAIN) instead of TimeoutError; both are OSError."""
    sec = int(timeout_s)
    tv = struct.pack("ll", sec, int((timeout_s - sec) * 1e6))
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
