"""ScatterReader: READ a producer's byte ranges straight into scattered destination ranges.

pdcluster.transfer.TransferClient reads into one buffer laid out as the concatenation of the
ranges; the destination here is a set of blocks of the consumer's own registered cache, so each
window of the concatenated stream is received piecewise into the destination ranges that
cover it (`recv_into` on slices of the cache: zero copies):

    source ranges (token)   |--r0--|----r1----|-r2-|        concatenated byte stream
    windows (streams)       [=====w0=====][=====w1====]     one pooled connection each
    destination ranges      |-d0-|---d1---|--d2--|--d3-|    w0 -> d0, d1, head of d2; w1 -> ...

Same wire protocol and token checks as TransferClient (pdcluster.transfer.protocol); this only
adds the scatter on receive. A refused or broken window raises TransferError; every stream is
waited for before read() returns, so nothing writes into the destination afterwards.

Windows are handed out, not assigned: a big transfer can be cut into CHUNKS_PER_STREAM windows
per stream (plan_windows) and each stream takes the next one when it finished its last, so a
stream that got less CPU would do less of the transfer instead of leaving the others idle while
it finishes a fixed share (on a loaded 2-core box 4-20 % of the streams' time went idle at the
tail with one window each; but more windows cost more than that there, so the default is 1). The producer's server keeps the parsed range table between the
windows of one connection (pdcluster.transfer.ranges.TableCache) and both ends find a window's
pieces by bisection (RangeIndex), so more windows cost no per-range Python.

With a `mac_key` (the producer's per-token key, from its CURVE `open` reply) every window asks
for its MAC (AES-GMAC, or keyed BLAKE3 from an older producer: pdcluster.transfer.read_mac) and
is fed to it slice by slice as it lands in place (pdcluster.transfer.integrity): a mismatch
raises TransferError("integrity") and the loader fails those blocks.
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import chain

from pdcluster.transfer import OP_READ, TransferError, parse_token
from pdcluster.transfer.client import TransferClient, split_windows
from pdcluster.transfer.integrity import IntegrityError, recv_checked
from pdcluster.transfer.protocol import (
    FLAG_MAC,
    PROTO_VERSION,
    REQ_HEADER,
    REQ_MAGIC,
    ST_OK,
    STATUS_NAMES,
    recv_views,
)
from pdcluster.transfer.ranges import RangeIndex
from pdcluster.transfer.read_mac import GmacRefused, check_refusal, request_suffix, window_mac

Address = tuple[str, int]
# Windows per stream for transfers big enough (each window >= CHUNK_MIN_BYTES). More than one
# evens out the tail, but every window is a request, and on the 2-core box each extra one cost
# the producer 1-1.5 ms of CPU (a fresh GMAC context, the connection restarting from idle): with
# 2 per stream 128 MiB reads were no faster (256 KiB-4 MiB blocks, 9 interleaved rounds: 1.53-2.17
# vs 1.91-2.19 GB/s with 1) and cost 0.015-0.08 s/GB more. So 1 (one window per stream, as
# before) until a machine with idle cores says otherwise (notes/p2pspeed.md).
CHUNKS_PER_STREAM = 1
CHUNK_MIN_BYTES = 4 << 20


def plan_windows(total: int, num_streams: int, min_stream_bytes: int) -> list[tuple[int, int]]:
    """The windows of one read: CHUNKS_PER_STREAM per stream when each is still >= CHUNK_MIN_BYTES,
    else one per stream (split_windows) as before, so small transfers pay no extra requests."""
    per_stream = split_windows(total, num_streams, min_stream_bytes)
    finer = split_windows(total, num_streams * CHUNKS_PER_STREAM, max(min_stream_bytes, CHUNK_MIN_BYTES))
    return finer if len(finer) > len(per_stream) else per_stream


class _Chunks:
    """The windows of one read, handed out in order to whichever stream asks next."""

    def __init__(self, windows: list[tuple[int, int]]) -> None:
        self._windows = windows
        self._next = 0
        self._lock = threading.Lock()
        self.failed = False  # once a window failed, the read fails: hand out no more

    def __len__(self) -> int:
        return len(self._windows)

    def take(self) -> tuple[int, int] | None:
        with self._lock:
            if self.failed or self._next >= len(self._windows):
                return None
            self._next += 1
            return self._windows[self._next - 1]


class ScatterReader(TransferClient):
    """A TransferClient (same connection pool, windows and protocol) whose READ scatters each
    window into the destination ranges instead of one concatenated buffer."""

    def __init__(self, num_streams: int = 4, min_stream_bytes: int = 256 << 10,
                 connect_timeout_s: float = 5.0, io_timeout_s: float = 10.0, mac: str = "gmac") -> None:
        super().__init__(num_streams=num_streams, min_stream_bytes=min_stream_bytes,
                         connect_timeout_s=connect_timeout_s, io_timeout_s=io_timeout_s,
                         max_idle_per_peer=4 * num_streams, mac=mac)
        self._pool = ThreadPoolExecutor(max_workers=max(1, 2 * num_streams), thread_name_prefix="p2p-stream")

    def read(self, addr: Address, token: bytes, src_ranges: Sequence[tuple[int, int]], dest: memoryview,
             dst_ranges: Sequence[tuple[int, int]], mac_key: bytes | None = None) -> int:
        total = sum(n for _, n in src_ranges)
        if total == 0 or total != sum(n for _, n in dst_ranges):
            raise ValueError(f"source ranges hold {total} bytes, destination ranges "
                             f"{sum(n for _, n in dst_ranges)}")
        for off, n in dst_ranges:
            if off < 0 or off + n > dest.nbytes:
                raise ValueError("destination range outside the buffer")
        # The range table is the same for every window: pack it once (the request frame is
        # header | token | table, see pdcluster.transfer.protocol).
        table = token + struct.pack(f"!{2 * len(src_ranges)}Q", *chain.from_iterable(src_ranges))
        frame_args = (addr, token, len(src_ranges), table, dest, RangeIndex(dst_ranges), mac_key)
        chunks = _Chunks(plan_windows(total, self.num_streams, self.min_stream_bytes))
        streams = min(self.num_streams, len(chunks))
        futures = [self._pool.submit(self._stream, chunks, frame_args) for _ in range(streams - 1)]
        errors: list[BaseException] = []
        try:
            self._stream(chunks, frame_args)
        except BaseException as e:
            errors.append(e)
        for f in futures:  # wait for every stream: none may write into dest after we return
            try:
                f.result()
            except BaseException as e:
                errors.append(e)
        if errors:
            raise errors[0]
        return total

    def _stream(self, chunks: _Chunks, frame_args: tuple) -> None:
        """One stream: windows, one after the other, until none is left or one failed."""
        while (window := chunks.take()) is not None:
            try:
                self._window(*frame_args, *window)
            except BaseException:
                chunks.failed = True
                raise

    # -- one window on one connection ------------------------------------------------------------
    def _window(self, addr: Address, token: bytes, num_ranges: int, table: bytes, dest: memoryview,
                dst_ranges: RangeIndex, mac_key: bytes | None, start: int, length: int) -> None:
        flags = self.macs.flags(addr, mac_key)
        args = (addr, token, num_ranges, table, dest, dst_ranges, mac_key, start, length)
        try:
            self._window_once(*args, flags)
        except GmacRefused:  # an older producer: once more with keyed BLAKE3 (read_mac.py)
            self._window_once(*args, FLAG_MAC)
            self.macs.fell_back(addr)

    def _window_once(self, addr: Address, token: bytes, num_ranges: int, table: bytes, dest: memoryview,
                     dst_ranges: RangeIndex, mac_key: bytes | None, start: int, length: int,
                     flags: int) -> None:
        cap = parse_token(token)
        head = REQ_HEADER.pack(REQ_MAGIC, PROTO_VERSION, OP_READ, flags, num_ranges,
                               cap.region_id, start, length, cap.transfer_id)
        suffix = request_suffix(flags)
        frame = head + table + suffix
        for attempt in range(2):
            sock, reused = self._checkout(addr, fresh=attempt > 0)
            try:
                sock.sendall(frame)
                status = self._recv_status(sock)
            except OSError as e:
                sock.close()
                if reused:
                    continue  # a pooled connection the server had closed: once more on a fresh one
                raise TransferError("io", f"{addr[0]}:{addr[1]}: {e}") from e
            if status != ST_OK:
                sock.close()
                check_refusal(flags, status)
                raise TransferError(STATUS_NAMES.get(status, str(status)), f"refused by {addr[0]}:{addr[1]}")
            try:
                if mac_key is None:
                    recv_views(sock, [dest[off:off + n] for off, n in dst_ranges.window(start, length)])
                else:
                    hasher = window_mac(sock, flags, mac_key, suffix, cap.transfer_id, cap.region_id, start, length)
                    recv_checked(sock, dest, dst_ranges.window(start, length), hasher)
            except IntegrityError as e:
                sock.close()
                raise TransferError("integrity", f"{addr[0]}:{addr[1]}: {e}") from e
            except OSError as e:
                sock.close()
                raise TransferError("io", f"{addr[0]}:{addr[1]}: {e}") from e
            self._checkin(addr, sock)
            return

    def _checkout(self, addr: Address, fresh: bool) -> tuple[socket.socket, bool]:
        try:
            return super()._checkout(addr, fresh)
        except OSError as e:  # a peer that cannot be reached fails the blocks, not the loader
            raise TransferError("io", f"cannot connect to {addr[0]}:{addr[1]}: {e}") from e
