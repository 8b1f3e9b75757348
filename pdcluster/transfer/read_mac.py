"""Client side of a READ window's payload MAC: which scheme to ask a peer for, the request's
suffix, and the MAC object once the server said OK. Shared by TransferClient and the P2P
ScatterReader, which differ only in where the bytes land.

Negotiation: a reader asks for FLAG_GMAC (gmac.py) unless told `mac="blake3"`. A server older
than FLAG_GMAC refuses the flag as bad_request before it reads anything past the header, so
the reader asks that window again with FLAG_MAC (keyed BLAKE3) on a fresh connection and, once
that succeeds, keeps asking that peer for FLAG_MAC (PeerMacs). A forged refusal can only steer a
reader to BLAKE3, which is as safe, just slower; never to no MAC.
"""

from __future__ import annotations

import logging
import socket
import threading

from .gmac import NONCE_LEN, GmacWindow, new_nonce
from .integrity import WindowMac, window_hasher
from .protocol import FLAG_GMAC, FLAG_MAC, ST_BAD_REQUEST, recv_exact

log = logging.getLogger(__name__)
Address = tuple[str, int]
MAC_SCHEMES = ("gmac", "blake3")


class GmacRefused(Exception):
    """The peer refused a FLAG_GMAC request as bad_request: probably it predates the flag."""


class PeerMacs:
    """Which scheme to ask each peer for (thread-safe; per client, not global)."""

    def __init__(self, mac: str = "gmac") -> None:
        if mac not in MAC_SCHEMES:
            raise ValueError(f"payload MAC must be one of {MAC_SCHEMES}, got {mac!r}")
        self.mac = mac
        self._lock = threading.Lock()
        self._blake3_only: set[Address] = set()

    def flags(self, addr: Address, mac_key: bytes | None) -> int:
        if mac_key is None:
            return 0
        if self.mac == "blake3":
            return FLAG_MAC
        with self._lock:
            return FLAG_MAC if addr in self._blake3_only else FLAG_GMAC

    def fell_back(self, addr: Address) -> None:
        """A FLAG_GMAC refusal was followed by a served FLAG_MAC request: remember the peer."""
        with self._lock:
            new = addr not in self._blake3_only
            self._blake3_only.add(addr)
        if new:
            log.info("transfer peer %s:%s refuses GMAC payload MACs (older version): using BLAKE3", *addr)


def request_suffix(flags: int) -> bytes:
    """What follows the range table: the client nonce of a FLAG_GMAC request (fresh each call)."""
    return new_nonce() if flags == FLAG_GMAC else b""


def check_refusal(flags: int, status: int) -> None:
    if flags == FLAG_GMAC and status == ST_BAD_REQUEST:
        raise GmacRefused()


def window_mac(sock: socket.socket, flags: int, mac_key: bytes, suffix: bytes, transfer_id: bytes,
               region_id: int, start: int, length: int) -> WindowMac:
    """After an OK status: the MAC to feed the window's bytes to. FLAG_GMAC reads the server's
    nonce first (it precedes the payload)."""
    if flags == FLAG_GMAC:
        server_nonce = memoryview(bytearray(NONCE_LEN))
        recv_exact(sock, server_nonce)
        return GmacWindow(mac_key, suffix, bytes(server_nonce), transfer_id, region_id, start, length)
    return window_hasher(mac_key, transfer_id, region_id, start, length)
