"""TransferClient: READ/WRITE byte ranges of a remote region, several TCP streams per transfer.

The caller passes the token it got from the control plane, the exact ranges the token covers,
and a destination (READ) or source (WRITE) buffer laid out as the concatenation of the ranges.
Bytes move straight between that buffer and the socket: `recv_into` on memoryview slices for
READ, `sendmsg` of memoryview slices for WRITE -- no intermediate copies.

A transfer of `total` bytes is split into up to `num_streams` windows of at least
`min_stream_bytes`, each served on its own pooled connection (the first one on the calling
thread). The client is thread-safe; connections are pooled per peer and reused.

With a `mac_key` (from the token's issuer, over the control plane) a READ asks for each
window's MAC -- AES-GMAC (gmac.py), or keyed BLAKE3 with `mac="blake3"` or from a peer that
predates GMAC (read_mac.py) -- and checks it after the window landed (integrity.py): a mismatch
raises TransferError("integrity") and the buffer's bytes must not be used.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .integrity import IntegrityError, recv_checked
from .protocol import (
    FLAG_MAC,
    RESP_HEADER,
    RESP_MAGIC,
    ST_OK,
    STATUS_NAMES,
    blocking_with_os_timeouts,
    pack_request,
    recv_exact,
    send_views,
)
from .read_mac import GmacRefused, PeerMacs, check_refusal, request_suffix, window_mac
from .region import as_byte_view
from .tokens import OP_READ, OP_WRITE, TokenError, parse_token

Address = tuple[str, int]
_ALIGN = 4096


class TransferError(Exception):
    """A transfer failed; `status` is the server's status name, or "io" for a network failure."""

    def __init__(self, status: str, msg: str) -> None:
        super().__init__(f"{status}: {msg}")
        self.status = status


def split_windows(total: int, num_streams: int, min_stream_bytes: int) -> list[tuple[int, int]]:
    """Cut [0, total) into at most num_streams page-aligned windows of >= min_stream_bytes."""
    k = max(1, min(num_streams, total // max(1, min_stream_bytes)))
    step = -(-total // k)
    step = -(-step // _ALIGN) * _ALIGN
    return [(s, min(step, total - s)) for s in range(0, total, step)]


class TransferClient:
    def __init__(self, *, num_streams: int = 4, min_stream_bytes: int = 1 << 20,
                 connect_timeout_s: float = 5.0, io_timeout_s: float = 30.0,
                 max_idle_per_peer: int = 16, mac: str = "gmac") -> None:
        self.num_streams = num_streams
        self.macs = PeerMacs(mac)  # which payload MAC a READ with a mac_key asks each peer for
        self.min_stream_bytes = min_stream_bytes
        self._connect_timeout = connect_timeout_s
        self._io_timeout = io_timeout_s
        self._max_idle = max_idle_per_peer
        self._lock = threading.Lock()
        self._idle: dict[Address, list[socket.socket]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    def read(self, addr: Address, token: bytes, ranges: Sequence[tuple[int, int]], dest: Any,
             mac_key: bytes | None = None) -> int:
        """Read the ranges into `dest` (concatenated, in order); returns the byte count."""
        return self._transfer(OP_READ, addr, token, ranges, as_byte_view(dest, writable=True), mac_key)

    def write(self, addr: Address, token: bytes, ranges: Sequence[tuple[int, int]], src: Any) -> int:
        """Write `src` (the ranges' bytes, concatenated) into the remote ranges; returns the byte count."""
        return self._transfer(OP_WRITE, addr, token, ranges, as_byte_view(src, writable=False))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            socks = [s for lst in self._idle.values() for s in lst]
            self._idle.clear()
            pool, self._pool = self._pool, None
        for s in socks:
            s.close()
        if pool is not None:
            pool.shutdown(wait=True)

    def __enter__(self) -> TransferClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------------
    def _transfer(self, op: int, addr: Address, token: bytes, ranges: Sequence[tuple[int, int]],
                  buf: memoryview, mac_key: bytes | None = None) -> int:
        try:
            cap = parse_token(token)
        except TokenError as e:
            raise TransferError("bad_request", f"malformed token: {e}") from e
        if cap.op != op:
            raise TransferError("bad_request", "token is for another operation")
        total = sum(n for _, n in ranges)
        if total == 0 or buf.nbytes < total:
            raise ValueError(f"buffer has {buf.nbytes} bytes, ranges need {total}")
        windows = split_windows(total, self.num_streams, self.min_stream_bytes)
        args = (op, addr, cap.transfer_id, cap.region_id, token, ranges, buf, mac_key)
        if len(windows) == 1:
            self._part(*args, 0, total)
            return total
        pool = self._executor()
        futures = [pool.submit(self._part, *args, s, n) for s, n in windows[1:]]
        errors: list[BaseException] = []
        try:
            self._part(*args, *windows[0])
        except BaseException as e:
            errors.append(e)
        for f in futures:  # always wait for every stream: none may touch `buf` after we return
            try:
                f.result()
            except BaseException as e:
                errors.append(e)
        if errors:
            raise errors[0]
        return total

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=max(1, 4 * self.num_streams),
                                                thread_name_prefix="transfer-stream")
            return self._pool

    def _part(self, op: int, addr: Address, tid: bytes, region_id: int, token: bytes,
              ranges: Sequence[tuple[int, int]], buf: memoryview, mac_key: bytes | None, start: int,
              length: int) -> None:
        flags = self.macs.flags(addr, mac_key) if op == OP_READ else 0
        try:
            self._part_once(op, addr, tid, region_id, token, ranges, buf, mac_key, start, length, flags)
        except GmacRefused:  # an older server: once more with keyed BLAKE3 (read_mac.py)
            self._part_once(op, addr, tid, region_id, token, ranges, buf, mac_key, start, length, FLAG_MAC)
            self.macs.fell_back(addr)

    def _part_once(self, op: int, addr: Address, tid: bytes, region_id: int, token: bytes,
                   ranges: Sequence[tuple[int, int]], buf: memoryview, mac_key: bytes | None, start: int,
                   length: int, flags: int) -> None:
        suffix = request_suffix(flags)
        frame = pack_request(op, region_id, tid, token, ranges, start, length, flags) + suffix
        window = buf[start:start + length]
        for attempt in range(2):
            try:
                sock, reused = self._checkout(addr, fresh=attempt > 0)
            except OSError as e:
                raise TransferError("io", f"cannot connect to {addr[0]}:{addr[1]}: {e}") from e
            answered = False
            try:
                if op == OP_READ:
                    sock.sendall(frame)
                    status = self._recv_status(sock)
                    answered = True
                    if status == ST_OK and mac_key is None:
                        recv_exact(sock, window)
                    elif status == ST_OK:
                        hasher = window_mac(sock, flags, mac_key, suffix, tid, region_id, start, length)
                        recv_checked(sock, buf, [(start, length)], hasher)
                else:
                    send_views(sock, [frame, window])
                    status = self._recv_status(sock)
                    answered = True
            except IntegrityError as e:
                sock.close()
                raise TransferError("integrity", f"{addr[0]}:{addr[1]}: {e}") from e
            except OSError as e:
                sock.close()
                if reused and not answered:
                    continue  # a pooled connection the server had closed: retry on a fresh one
                raise TransferError("io", f"{addr[0]}:{addr[1]}: {e}") from e
            if status != ST_OK:
                sock.close()  # the server closes after any refusal
                check_refusal(flags, status)
                raise TransferError(STATUS_NAMES.get(status, str(status)), f"refused by {addr[0]}:{addr[1]}")
            self._checkin(addr, sock)
            return

    @staticmethod
    def _recv_status(sock: socket.socket) -> int:
        hdr = memoryview(bytearray(RESP_HEADER.size))
        recv_exact(sock, hdr)
        magic, status, _r1, _r2, _n = RESP_HEADER.unpack(hdr)
        if magic != RESP_MAGIC:
            raise ConnectionError("bad response frame")
        return status

    def _checkout(self, addr: Address, fresh: bool) -> tuple[socket.socket, bool]:
        if not fresh:
            with self._lock:
                idle = self._idle.get(addr)
                if idle:
                    return idle.pop(), True
        sock = socket.create_connection(addr, timeout=self._connect_timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        blocking_with_os_timeouts(sock, self._io_timeout)  # kernel-side timeouts: no poll per recv
        return sock, False

    def _checkin(self, addr: Address, sock: socket.socket) -> None:
        with self._lock:
            idle = self._idle.setdefault(addr, [])
            if not self._closed and len(idle) < self._max_idle:
                idle.append(sock)
                return
        sock.close()
