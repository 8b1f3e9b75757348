"""The client's end of the master's same-host lookup socket (kvstore/lookup_socket.py).

`get_replicas` (and `commit_arena`) answers a GetReplicas (CommitArena) request over the socket while a session is open, and None
whenever the caller should ask over gRPC instead: no session could be opened (another host, an
older master, a standby, a socket we may not reach), another thread holds the session, or the
session just failed (then it is closed and reopened after a pause). So every failure mode ends
on the gRPC path, which has the failover logic; the socket only ever saves round-trip cost.
A session is opened with the OpenLookup RPC (TLS/mTLS and role policy as for GetReplicas) and
reopened before its ticket's expiry; answers from an epoch below the highest seen are refused.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from google.protobuf.message import Message

from pdcluster._proto import kvstore_pb2 as pb
from pdcluster.transfer import now_ms

from .lookup_socket import COMMIT_ARENA, GET_REPLICAS, HELLO, OK, REPLY, REQUEST, recv_exact
from .master_rpc import KVStoreError, MasterRPC

RENEW_MS = 2000  # reopen this long before the session ends (a request must not straddle it)
RETRY_S = 1.0  # after a failed session
NO_SOCKET_RETRY_S = 60.0  # after the master offered none (another host, disabled, an older master)


class LookupSession:
    def __init__(self, master: MasterRPC, host_id: str, *, timeout_s: float = 5.0,
                 commit_timeout_s: float = 10.0) -> None:
        self._master, self._host_id, self._timeout = master, host_id, timeout_s
        self._commit_timeout = commit_timeout_s
        self._sock: socket.socket | None = None
        self._expiry_ms = 0
        self._retry_at = 0.0
        self._lock = threading.Lock()
        self.counters = {"lookup_socket_gets": 0, "lookup_socket_commits": 0, "lookup_socket_failures": 0}

    def get_replicas(self, request: pb.KVGetReplicasRequest) -> pb.KVGetReplicasResponse | None:
        """The master's answer over the socket, or None: ask over gRPC. KVStoreError only when
        opening a session found no master at all (as the gRPC call would have)."""
        return self._call(GET_REPLICAS, request, pb.KVGetReplicasResponse, "lookup_socket_gets", self._timeout)

    def commit_arena(self, request: pb.KVCommitArenaRequest) -> pb.KVCommitArenaResponse | None:
        """As get_replicas, for CommitArena. A commit the socket lost the answer to is sent again
        over gRPC, as MasterRPC itself resends one after a timeout with two masters: an item the
        lost commit had published is then refused (its extent is taken: INVALID, or the key:
        ALREADY_EXISTS), i.e. reported failed as a lost gRPC answer would be; never a second
        object. Waits the full RPC timeout: under HA the answer waits for the standby's ack."""
        return self._call(COMMIT_ARENA, request, pb.KVCommitArenaResponse, "lookup_socket_commits",
                          self._commit_timeout)

    def _call(self, method: int, request: Message, kind: Any, counter: str, timeout_s: float) -> Any:
        if not self._lock.acquire(blocking=False):
            return None  # another thread's call is on the socket: gRPC runs in parallel
        try:
            if (self._sock is None or now_ms() + RENEW_MS >= self._expiry_ms) and not self._open():
                return None
            assert self._sock is not None
            try:
                self._sock.settimeout(timeout_s)
                body = request.SerializeToString()
                self._sock.sendall(REQUEST.pack(method, len(body)) + body)
                code, epoch, n = REPLY.unpack(recv_exact(self._sock, REPLY.size))
                payload = recv_exact(self._sock, n) if n else b""
                if code != OK or not self._master.accept_epoch(epoch):
                    raise ConnectionError(f"lookup answer code {code}, epoch {epoch}")
                resp = kind.FromString(payload)
            except (OSError, ValueError):  # ConnectionError, timeouts, DecodeError (a ValueError)
                self._close(RETRY_S)
                self.counters["lookup_socket_failures"] += 1
                return None
            self.counters[counter] += 1
            return resp
        finally:
            self._lock.release()

    def _open(self) -> bool:
        self._close(0.0)
        if time.monotonic() < self._retry_at:
            return False
        try:
            answer = self._master.call("OpenLookup", pb.KVOpenLookupRequest())
        except KVStoreError as e:
            if e.failover:
                raise  # no master answers: the gRPC call would fail the same way
            self._retry_at = time.monotonic() + NO_SOCKET_RETRY_S  # e.g. UNIMPLEMENTED: an older master
            return False
        if not answer.path or answer.host_id != self._host_id or answer.expiry_ms <= now_ms() + RENEW_MS:
            self._retry_at = time.monotonic() + NO_SOCKET_RETRY_S
            return False
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self._timeout)
            sock.connect(answer.path)
            sock.sendall(HELLO + answer.ticket)
            if recv_exact(sock, 1) != b"\x00":
                raise ConnectionError("lookup session refused")
        except OSError:
            sock.close()
            self._retry_at = time.monotonic() + NO_SOCKET_RETRY_S  # e.g. another user's /tmp, a container
            return False
        self._sock, self._expiry_ms = sock, answer.expiry_ms
        return True

    def _close(self, retry_s: float) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            self._retry_at = time.monotonic() + retry_s

    def close(self) -> None:
        with self._lock:
            self._close(0.0)


__all__ = ["LookupSession"]
