"""Payload MACs of the data plane, per READ window, computed while bytes stream.

Two schemes, chosen per request by a flag: FLAG_GMAC (AES-256-GMAC with a fresh key per
response, gmac.py: the default of the readers, ~3x cheaper per byte) and FLAG_MAC (keyed
BLAKE3, below: what an older peer speaks, and the fallback). Both use the same per-token
mac_key and the same context block, and share the send/receive loops here.

With FLAG_MAC the server appends, after the window's bytes, MAC_LEN bytes:

    mac = BLAKE3-keyed(mac_key, window_context(tid, region, start, length) | window bytes)
    mac_key = HMAC-SHA256(server key, "pdcluster-transfer-mac/" | token)

The server derives mac_key from the token it was shown (stateless, like the token check); the
issuer, who holds the same server key, hands mac_key to the token's holder over the
authenticated control plane (the P2P producer: in its CURVE `open` reply), never on the data
plane. An on-path peer sees the token but not the server key, so it cannot make a MAC for bytes
of its choosing; the context binds the MAC to one window of one transfer, so windows cannot be
swapped or replayed into another request.

Both sides hash in slices of at most MAC_SLICE bytes: the server hashes a slice then sends it;
the client receives about MAC_SLICE bytes of slices into place with one gather call, then hashes
them while they are still in cache. A mismatch is
TransferError("integrity"): the reader treats the bytes as never loaded.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct
from collections.abc import Iterator, Sequence
from typing import Protocol

import blake3

from .protocol import recv_exact, recv_views, send_views
from .tokens import Capability

MAC_LEN = 32
MAC_KEY_LEN = 32
MAC_SLICE = 1 << 20  # hash/send granularity: small enough to stay in cache, large enough per syscall
_CONTEXT = struct.Struct("!8s16sQQQ")  # domain, transfer id, region, window start, window length
_DOMAIN = b"pdxmac01"
GMAC_DOMAIN = b"pdxgmac1"


class WindowMac(Protocol):
    """What the send/receive loops need of a MAC: blake3.blake3 and gmac.GmacWindow both are."""

    digest_size: int

    def update(self, data: memoryview | bytes, /) -> object: ...

    def digest(self) -> bytes: ...


def window_context(transfer_id: bytes, region_id: int, start: int, length: int, domain: bytes = _DOMAIN) -> bytes:
    """The block every window MAC starts with: binds it to one window of one transfer."""
    return _CONTEXT.pack(domain, transfer_id, region_id, start, length)


def transfer_mac_key(server_key: bytes, token: bytes) -> bytes:
    """The per-token (so per-transfer) MAC key; only holders of the server key can compute it."""
    return hmac.new(server_key, b"pdcluster-transfer-mac/" + bytes(token), hashlib.sha256).digest()


def window_hasher(mac_key: bytes, transfer_id: bytes, region_id: int, start: int, length: int) -> blake3.blake3:
    if len(mac_key) != MAC_KEY_LEN:
        raise ValueError(f"mac key must be {MAC_KEY_LEN} bytes")
    h = blake3.blake3(key=mac_key)
    h.update(window_context(transfer_id, region_id, start, length))
    return h


def slices(view: memoryview, pieces: Sequence[tuple[int, int]]) -> Iterator[memoryview]:
    """The pieces' bytes of `view`, cut into slices of at most MAC_SLICE bytes, in order."""
    for off, n in pieces:
        end = off + n
        while off < end:
            step = min(MAC_SLICE, end - off)
            yield view[off:off + step]
            off += step


class IntegrityError(Exception):
    """The bytes that arrived are not the bytes the server sent (their MAC does not match)."""


def recv_checked(sock: socket.socket, dest: memoryview, pieces: Sequence[tuple[int, int]],
                 hasher: WindowMac) -> None:
    """Receive a window into the pieces of `dest` (in order), hashing each batch of slices as
    it lands, then its MAC trailer; IntegrityError when they differ. The caller must not use the bytes
    unless this returns."""
    batch: list[memoryview] = []
    batch_bytes = 0
    for piece in slices(dest, pieces):
        batch.append(piece)
        batch_bytes += piece.nbytes
        if batch_bytes >= MAC_SLICE:
            _recv_and_hash(sock, batch, hasher)
            batch, batch_bytes = [], 0
    _recv_and_hash(sock, batch, hasher)
    mac = memoryview(bytearray(hasher.digest_size))
    recv_exact(sock, mac)
    if not hmac.compare_digest(hasher.digest(), bytes(mac)):
        raise IntegrityError("payload MAC mismatch")


def _recv_and_hash(sock: socket.socket, batch: list[memoryview], hasher: WindowMac) -> None:
    """One gather receive for up to MAC_SLICE bytes of pieces, then hash them while they are
    still in cache."""
    recv_views(sock, batch)
    for piece in batch:
        hasher.update(piece)


def send_with_mac(sock: socket.socket, hdr: bytes, view: memoryview, pieces: Sequence[tuple[int, int]],
                  mac_key: bytes, cap: Capability, start: int, length: int) -> None:
    """Server side of FLAG_MAC (keyed BLAKE3)."""
    send_checked(sock, hdr, view, pieces, window_hasher(mac_key, cap.transfer_id, cap.region_id, start, length))


def send_checked(sock: socket.socket, hdr: bytes, view: memoryview, pieces: Sequence[tuple[int, int]],
                 hasher: WindowMac) -> None:
    """Server side: hash each slice, then send it (blake3 and sendmsg release the GIL, so
    parallel streams overlap one's hashing with another's sending); the MAC goes last."""
    batch: list[memoryview | bytes] = [hdr]
    batch_bytes = 0
    for piece in slices(view, pieces):
        hasher.update(piece)
        batch.append(piece)
        batch_bytes += piece.nbytes
        if batch_bytes >= MAC_SLICE:
            send_views(sock, batch)
            batch, batch_bytes = [], 0
    batch.append(hasher.digest())
    send_views(sock, batch)
