"""The master's same-host lookup socket: GetReplicas without gRPC for clients on its host.

Why: a small get is one GetReplicas round trip plus one memcpy per object, and in Python's sync
gRPC that round trip costs ~0.3-0.45 ms of master CPU and ~0.2-0.3 ms of client CPU whatever the
handler does (the handler itself: ~50 us for 16 keys), most of it thread hand-offs inside
grpcio (poll thread -> pool thread -> completion). Here one master thread per session blocks in
recv, answers, and blocks again: one wake-up per request on each side.

    client -> master   HELLO | ticket (32 B)            once; the ticket came from OpenLookup
    master -> client   b"\\x00"                          accepted (anything else: the master closed)
    client -> master   u8 method | u32 n | request      repeated; method GET_REPLICAS or COMMIT_ARENA
    master -> client   u8 code | u64 epoch | u32 n | response

GetReplicas is the hot read; CommitArena is the one RPC of a small same-host put batch (client_arena.py).

What guards it:
- Who: a ticket is issued only by the OpenLookup RPC, which goes through the master's gRPC
  server with its TLS/mTLS and role policy (the same callers as GetReplicas: workers), is
  single-use, random (32 bytes), and must be used before it expires; a session ends SESSION_S
  after the ticket was issued (the thread's reads time out then), so a caller whose certificate
  was revoked keeps at most that long. The socket is in a fresh 0700 directory, mode 0600:
  only the master's own user can connect at all. Refused hellos are counted (lookup_refused).
- What: the same answers as over gRPC (the servicer's get_replicas / commit_arena: leases, tokens
  for replicas the caller cannot copy through shared memory, the op log); the data's integrity
  rests on the object MAC the client checks on every get, as over gRPC. A commit is answered only
  once every follower acknowledged its records (the ReplicationHub's begin_call/wait_replicated,
  as PrimaryGate does for gRPC: semi-synchronous replication is unchanged).
- Standby guard: every request asks `gate()`; a standby answers NOT_PRIMARY (the client goes
  back to gRPC, which fails over), and each answer carries the master's epoch, which the client
  checks like the kv-epoch trailer of a gRPC answer.
- Bounds: at most MAX_SESSIONS sessions (a thread each), MAX_TICKETS outstanding tickets,
  requests up to MAX_FRAME bytes and the master's max_batch keys, a 2 s hello timeout.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from google.protobuf.message import DecodeError, Message

from pdcluster._proto import kvstore_pb2 as pb
from pdcluster.transfer import local_host_id

log = logging.getLogger(__name__)

HELLO = b"pdkvlk01"
TICKET_LEN = 32
REQUEST = struct.Struct("!BI")
GET_REPLICAS, COMMIT_ARENA = 1, 2
REPLY = struct.Struct("!BQI")
OK, NOT_PRIMARY, INVALID = 0, 1, 2
SESSION_S = 30.0
HELLO_TIMEOUT_S = 2.0
MAX_SESSIONS = 64
MAX_TICKETS = 1024
MAX_FRAME = 16 << 20


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """n bytes from sock; ConnectionError on EOF before them."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("lookup socket closed")
        got += k
    return bytes(buf)


class LookupSocket:
    """get_replicas / commit_arena: the servicer's; gate: () -> (primary, epoch) of this master;
    replication: the HA ReplicationHub (begin_call / wait_replicated) or None for a lone master."""

    def __init__(self, get_replicas: Callable[[pb.KVGetReplicasRequest], pb.KVGetReplicasResponse],
                 gate: Callable[[], tuple[bool, int]], *, max_batch: int,
                 commit_arena: Callable[[pb.KVCommitArenaRequest], pb.KVCommitArenaResponse] | None = None,
                 replication: Any = None, session_s: float = SESSION_S,
                 clock: Callable[[], float] = time.time) -> None:
        # method -> (request type, answer, number of items, mutating)
        self._methods: dict[int, tuple[Any, Callable[[Any], Message], Callable[[Any], int], bool]] = {
            GET_REPLICAS: (pb.KVGetReplicasRequest, get_replicas, lambda r: len(r.keys), False)}
        if commit_arena is not None:
            self._methods[COMMIT_ARENA] = (pb.KVCommitArenaRequest, commit_arena, lambda r: len(r.items), True)
        self._replication = replication
        self._gate, self._max_batch = gate, max_batch
        self._session_s, self._clock = session_s, clock
        self.host_id = local_host_id()
        self._dir = tempfile.mkdtemp(prefix="pdkv-lookup-")  # mode 0700
        self.path = os.path.join(self._dir, "lookup.sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        os.chmod(self.path, 0o600)
        self._listener.listen(64)
        self._listener.settimeout(0.2)  # accept wakes to see close()
        self._tickets: dict[bytes, float] = {}  # ticket -> expiry (clock seconds)
        self._sessions: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stopped = False
        self.counters = {"lookup_sessions": 0, "lookup_requests": 0, "lookup_refused": 0}
        self._thread = threading.Thread(target=self._accept_loop, name="kvstore-lookup-accept", daemon=True)
        self._thread.start()

    def issue(self) -> tuple[bytes, int] | None:
        """A fresh ticket and its expiry (unix ms), or None when too many are outstanding."""
        now = self._clock()
        with self._lock:
            for t in [t for t, exp in self._tickets.items() if exp <= now]:
                del self._tickets[t]
            if self._stopped or len(self._tickets) >= MAX_TICKETS:
                return None
            ticket = secrets.token_bytes(TICKET_LEN)
            expiry = self._tickets[ticket] = now + self._session_s
        return ticket, int(expiry * 1000)

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                if self._stopped:
                    return
                continue
            with self._lock:
                full = len(self._sessions) >= MAX_SESSIONS or self._stopped
                if not full:
                    self._sessions.add(conn)
            if full:
                self._refuse(conn, "too many sessions")
                continue
            threading.Thread(target=self._serve, args=(conn,), name="kvstore-lookup", daemon=True).start()

    def _refuse(self, conn: socket.socket, why: str) -> None:
        with self._lock:
            self.counters["lookup_refused"] += 1
        log.warning("kvstore master refused a lookup-socket session: %s", why)
        conn.close()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(HELLO_TIMEOUT_S)
            try:
                hello = recv_exact(conn, len(HELLO) + TICKET_LEN)
            except (OSError, ValueError):
                self._refuse(conn, "no hello")
                return
            with self._lock:
                expiry = self._tickets.pop(hello[len(HELLO):], None) if hello.startswith(HELLO) else None
            if expiry is None or self._clock() >= expiry:
                self._refuse(conn, "unknown, used or expired ticket")
                return
            with self._lock:
                self.counters["lookup_sessions"] += 1
            conn.sendall(b"\x00")
            while self._serve_one(conn, expiry):
                pass
        except (OSError, ValueError):
            pass  # the client went away, or the session's time ran out in a read
        finally:
            with self._lock:
                self._sessions.discard(conn)
            conn.close()

    def _serve_one(self, conn: socket.socket, expiry: float) -> bool:
        left = expiry - self._clock()
        if left <= 0:
            return False
        conn.settimeout(left)  # an idle session ends with its ticket's time
        method, n = REQUEST.unpack(recv_exact(conn, REQUEST.size))
        if n > MAX_FRAME:
            return False
        payload = recv_exact(conn, n)
        primary, epoch = self._gate()
        code, body = OK, b""
        entry = self._methods.get(method)
        if not primary:
            code = NOT_PRIMARY
        elif entry is None:
            code = INVALID
        else:
            kind, answer, count, mutating = entry
            try:
                req = kind.FromString(payload)
            except DecodeError:
                req = None
            if req is None or count(req) > self._max_batch:
                code = INVALID
            elif mutating and self._replication is not None:
                self._replication.begin_call()
                body = answer(req).SerializeToString()
                self._replication.wait_replicated()  # answered once the standby has the records
            else:
                body = answer(req).SerializeToString()
        with self._lock:
            self.counters["lookup_requests"] += 1
        conn.sendall(REPLY.pack(code, epoch, len(body)) + body)
        return True

    def close(self) -> None:
        with self._lock:
            self._stopped = True
            sessions = list(self._sessions)
            self._tickets.clear()
        self._thread.join(timeout=2.0)
        self._listener.close()
        for conn in sessions:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        shutil.rmtree(self._dir, ignore_errors=True)


__all__ = ["COMMIT_ARENA", "GET_REPLICAS", "HELLO", "INVALID", "NOT_PRIMARY", "OK", "REPLY", "REQUEST", "LookupSocket",
           "recv_exact"]
