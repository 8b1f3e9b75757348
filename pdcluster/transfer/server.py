"""TransferServer: serves authenticated READ/WRITE of byte ranges of registered regions over TCP.

Threading model: one accept thread, one thread per connection (bounded by `max_connections`).
Socket I/O releases the GIL, so parallel streams of one transfer proceed in parallel. Bytes go
straight between the socket and the region memory (`recv_into`/`sendmsg` on memoryview slices).

Invariants:
- Nothing is read beyond the fixed 156-byte header before the token's MAC and expiry check out,
  and the range table (<= max_ranges x 16 B) is the only allocation sized by the peer.
- Every refusal closes that connection, is counted under a reason, and leaves the server and
  its other connections untouched.
- `unregister` waits for in-flight requests on the region so its memory is never freed under us.
- Optional, for issuers that want them (the P2P producer): `single_use` serves each byte of a
  token once (single_use.py); `authorize(cap)` lets the issuer revoke a valid token whose grant
  ended (a released lease) by returning a reason; FLAG_MAC / FLAG_GMAC READs get a MAC trailer
  (integrity.py, gmac.py).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable

from .gmac import NONCE_LEN, GmacSender
from .integrity import send_checked, send_with_mac, transfer_mac_key
from .protocol import (
    DEFAULT_MAX_RANGES,
    DEFAULT_MAX_REQUEST_BYTES,
    FLAG_GMAC,
    FLAG_MAC,
    MAC_FLAGS,
    PROTO_VERSION,
    RANGE,
    REQ_FIXED_LEN,
    REQ_HEADER,
    REQ_MAGIC,
    RESP_HEADER,
    RESP_MAGIC,
    ST_BAD_REQUEST,
    ST_INTERNAL,
    ST_NO_REGION,
    ST_OK,
    ST_OUT_OF_RANGE,
    ST_TOO_LARGE,
    ST_UNAUTHORIZED,
    TOKEN_STATUS,
    ProtocolError,
    blocking_with_os_timeouts,
    recv_exact,
    send_views,
)
from .ranges import RangeIndex, TableCache
from .region import Region
from .single_use import SingleUseGuard
from .tokens import OP_READ, OP_WRITE, Capability, TokenError, check_claims, check_ranges_table, verify_token

log = logging.getLogger(__name__)


class _Slot:
    """A registered region plus its in-flight request count."""

    def __init__(self, region: Region) -> None:
        self.region = region
        self.inflight = 0


class TransferServer:
    def __init__(self, key: bytes, host: str = "127.0.0.1", port: int = 0, *,
                 max_ranges: int = DEFAULT_MAX_RANGES, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 max_connections: int = 256, io_timeout_s: float = 30.0, idle_timeout_s: float = 300.0,
                 header_timeout_s: float = 5.0, clock_skew_ms: int = 0,
                 on_refusal: Callable[[str], None] | None = None, single_use: bool = False,
                 authorize: Callable[[Capability], str | None] | None = None) -> None:
        self._key = key
        self._single_use = SingleUseGuard(skew_ms=clock_skew_ms) if single_use else None
        self._authorize = authorize
        self._max_ranges = max_ranges
        self._max_request_bytes = max_request_bytes
        self._max_connections = max_connections
        self._io_timeout = io_timeout_s
        self._idle_timeout = idle_timeout_s
        # A new connection's first header, and any header once begun, must arrive within this:
        # otherwise one peer could hold every connection slot for idle_timeout_s by sending
        # nothing (or a byte at a time) before it ever shows a token.
        self._header_timeout = header_timeout_s
        self._skew_ms = clock_skew_ms
        self._on_refusal = on_refusal
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._slots: dict[int, _Slot] = {}
        self._next_region_id = 1
        self._conns: set[socket.socket] = set()
        self._counters: Counter[str] = Counter()
        self._stopping = threading.Event()
        self._listener = socket.create_server((host, port), backlog=128)
        self._listener.settimeout(0.25)  # accept() polls so stop() is prompt
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def address(self) -> tuple[str, int]:
        host, port = self._listener.getsockname()[:2]
        return host, port

    def start(self) -> TransferServer:
        self._thread = threading.Thread(target=self._accept_loop, name="transfer-accept", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
        self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def __enter__(self) -> TransferServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- regions -----------------------------------------------------------------------------
    def register(self, region: Region, region_id: int | None = None) -> int:
        with self._lock:
            if region_id is None:
                while self._next_region_id in self._slots:
                    self._next_region_id += 1
                region_id = self._next_region_id
            if region_id in self._slots:
                raise ValueError(f"region id {region_id} already registered")
            if not 0 < region_id < 1 << 64:
                raise ValueError("region id must be a positive u64")
            self._slots[region_id] = _Slot(region)
            return region_id

    def unregister(self, region_id: int, timeout_s: float = 10.0) -> None:
        """Stop serving a region; returns once no request is using its memory."""
        with self._lock:
            slot = self._slots.pop(region_id, None)
            if slot is not None and not self._idle.wait_for(lambda: slot.inflight == 0, timeout_s):
                raise TimeoutError(f"region {region_id} still busy after {timeout_s}s")

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = dict(self._counters)
            out["open_connections"] = len(self._conns)
            return out

    # -- connections -------------------------------------------------------------------------
    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    def _refuse(self, reason: str) -> None:
        self._count(f"refused_{reason}")
        self._count("refused_total")
        if self._on_refusal is not None:
            self._on_refusal(reason)

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stopping.is_set():
                    return
                continue
            with self._lock:
                full = len(self._conns) >= self._max_connections
                if not full:
                    self._conns.add(sock)
            if full:
                sock.close()
                self._refuse("too_many_connections")
                continue
            self._count("connections_total")
            threading.Thread(target=self._serve_conn, args=(sock,), name="transfer-conn", daemon=True).start()

    def _serve_conn(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head = memoryview(bytearray(REQ_FIXED_LEN))
        tables = TableCache()  # the windows of one transfer repeat its token and range table
        authenticated = False  # idle_timeout_s only between requests of a peer that showed a token
        try:
            while not self._stopping.is_set():
                sock.settimeout(self._idle_timeout if authenticated else self._header_timeout)
                try:
                    n = sock.recv_into(head, REQ_FIXED_LEN)
                except TimeoutError:
                    if not authenticated:
                        self._refuse("header_timeout")
                    return
                except OSError:
                    return
                if n == 0:
                    return  # clean close between requests
                try:
                    if n >= len(REQ_MAGIC) and head[:len(REQ_MAGIC)] != REQ_MAGIC:
                        # Refuse probes and garbage at once instead of waiting for a full header.
                        raise ProtocolError(ST_BAD_REQUEST, "bad_magic")
                    self._recv_header_rest(sock, head, n)
                    sock.settimeout(self._io_timeout)
                    self._handle(sock, head, tables)
                    authenticated = True
                except ProtocolError as e:
                    self._refuse(e.reason)
                    self._send_status(sock, e.status)
                    return
                except TokenError as e:
                    self._refuse(e.reason)
                    self._send_status(sock, TOKEN_STATUS.get(e.reason, ST_UNAUTHORIZED))
                    return
                except (OSError, ConnectionError):
                    self._refuse("truncated_or_io_error")
                    return
        except Exception:  # a bug must cost one connection, never the server
            log.exception("transfer connection failed")
            self._refuse("internal")
            self._send_status(sock, ST_INTERNAL)
        finally:
            with self._lock:
                self._conns.discard(sock)
            sock.close()

    def _recv_header_rest(self, sock: socket.socket, head: memoryview, got: int) -> None:
        """The rest of a begun header, all of it within header_timeout_s (or io_timeout_s if
        shorter): a deadline, not a per-recv timeout, so a byte every few seconds keeps no slot."""
        deadline = time.monotonic() + min(self._header_timeout, self._io_timeout)
        while got < REQ_FIXED_LEN:
            left = deadline - time.monotonic()
            if left <= 0:  # counted as a truncated header, as a timeout inside recv is
                raise TimeoutError("request header not complete in time")
            sock.settimeout(left)
            n = sock.recv_into(head[got:], REQ_FIXED_LEN - got)
            if n == 0:
                raise ConnectionError("peer closed the connection")
            got += n

    @staticmethod
    def _send_status(sock: socket.socket, status: int) -> None:
        try:
            sock.sendall(RESP_HEADER.pack(RESP_MAGIC, status, 0, 0, 0))
        except OSError:
            pass

    # -- one request -------------------------------------------------------------------------
    def _handle(self, sock: socket.socket, head: memoryview, tables: TableCache) -> None:
        magic, version, op, flags, num_ranges, region_id, start, length, tid = REQ_HEADER.unpack_from(head)
        if magic != REQ_MAGIC or version != PROTO_VERSION or op not in (OP_READ, OP_WRITE):
            raise ProtocolError(ST_BAD_REQUEST, "bad_header")
        if flags not in (0, *MAC_FLAGS) or (flags in MAC_FLAGS and op != OP_READ):
            raise ProtocolError(ST_BAD_REQUEST, "bad_flags")
        if not 0 < num_ranges <= self._max_ranges:
            raise ProtocolError(ST_TOO_LARGE, "too_many_ranges")
        if length > self._max_request_bytes:
            raise ProtocolError(ST_TOO_LARGE, "request_too_large")
        # Authenticate before reading anything sized by the peer.
        token = bytes(head[REQ_HEADER.size:])
        cap = verify_token(self._key, token, skew_ms=self._skew_ms)
        check_claims(cap, tid, op, region_id)
        suffix = NONCE_LEN if flags == FLAG_GMAC else 0  # the client's nonce follows the table
        table_len = num_ranges * RANGE.size
        table = memoryview(bytearray(table_len + suffix))
        recv_exact(sock, table)
        key = token + bytes(table[:table_len])
        index = tables.get(key)
        if index is None:
            check_ranges_table(cap, num_ranges, table)
            index = RangeIndex.from_table(table, num_ranges)
            tables.put(key, index)
        if self._authorize is not None:
            reason = self._authorize(cap)
            if reason is not None:
                raise TokenError("revoked", f"grant ended: {reason}")
        slot = self._acquire(region_id)
        try:
            view = slot.region.view
            if index.min_len == 0 or index.max_end > view.nbytes:
                raise ProtocolError(ST_OUT_OF_RANGE, "out_of_range")
            if length == 0 or start + length > index.total:
                raise ProtocolError(ST_OUT_OF_RANGE, "bad_window")
            pieces = index.window(start, length)
            if self._single_use is not None:  # after every other check: a refused try uses nothing up
                self._single_use.claim(token, cap, start, length)
            # The payload phase on a blocking socket with the I/O timeout in the kernel: one
            # sendmsg per batch (one MSG_WAITALL recv per piece for WRITE) instead of Python's
            # poll before every partial send. The next header read sets Python timeouts again.
            blocking_with_os_timeouts(sock, self._io_timeout)
            if op == OP_READ:
                hdr = RESP_HEADER.pack(RESP_MAGIC, ST_OK, 0, 0, length)
                if flags == FLAG_GMAC:
                    mac = GmacSender(transfer_mac_key(self._key, token), bytes(table[-NONCE_LEN:]),
                                     cap.transfer_id, cap.region_id, start, length)
                    send_checked(sock, hdr + mac.server_nonce, view, pieces, mac)
                elif flags == FLAG_MAC:
                    send_with_mac(sock, hdr, view, pieces, transfer_mac_key(self._key, token), cap, start, length)
                else:
                    send_views(sock, [hdr] + [view[o:o + n] for o, n in pieces])
                self._count("bytes_read", length)
            else:
                if view.readonly:
                    raise ProtocolError(ST_BAD_REQUEST, "region_read_only")
                for o, n in pieces:
                    recv_exact(sock, view[o:o + n])
                sock.sendall(RESP_HEADER.pack(RESP_MAGIC, ST_OK, 0, 0, length))
                self._count("bytes_written", length)
            self._count("requests_ok")
        finally:
            self._release(slot)

    def _acquire(self, region_id: int) -> _Slot:
        with self._lock:
            slot = self._slots.get(region_id)
            if slot is None:
                raise ProtocolError(ST_NO_REGION, "no_region")
            slot.inflight += 1
            return slot

    def _release(self, slot: _Slot) -> None:
        with self._lock:
            slot.inflight -= 1
            if slot.inflight == 0:
                self._idle.notify_all()
