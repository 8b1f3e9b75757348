"""The transfer server's header timeout: connections that send nothing (or a header a byte at a
time) lose their slot within header_timeout_s, instead of holding all of them for the idle
timeout; each is counted; a well-behaved client is served meanwhile and afterwards."""

from __future__ import annotations

import secrets
import socket
import time

import pytest

from pdcluster.transfer import OP_READ, TransferClient, TransferServer, alloc_region, issue_token
from pdcluster.transfer.protocol import REQ_MAGIC

KEY = secrets.token_bytes(32)
SLOTS = 4


def wait_until(cond, timeout_s: float = 30.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return bool(cond())


@pytest.fixture
def server():
    region = alloc_region(1 << 16, shared=True)
    region.as_numpy()[:] = 7
    srv = TransferServer(KEY, max_connections=SLOTS, header_timeout_s=0.5, idle_timeout_s=300.0).start()
    rid = srv.register(region)
    try:
        yield srv, rid
    finally:
        srv.stop()
        srv.unregister(rid)
        region.close()


def read_ok(srv: TransferServer, rid: int) -> bool:
    out = bytearray(100)
    token = issue_token(KEY, secrets.token_bytes(16), OP_READ, rid, [(0, 100)], ttl_s=10)
    with TransferClient() as c:
        c.read(srv.address, token, [(0, 100)], out)
    return bytes(out) == b"\x07" * 100


def test_silent_peers_lose_their_slots(server) -> None:
    srv, rid = server
    silent = [socket.create_connection(srv.address, timeout=5) for _ in range(SLOTS)]
    try:
        assert wait_until(lambda: srv.stats().get("refused_header_timeout", 0) == SLOTS)
        assert wait_until(lambda: srv.stats()["open_connections"] == 0)
        for s in silent:  # the server closed them: EOF, not a hang
            s.settimeout(5)
            assert s.recv(16) == b""
        assert read_ok(srv, rid)
    finally:
        for s in silent:
            s.close()


def test_a_header_a_byte_at_a_time_is_cut_off(server) -> None:
    srv, rid = server
    with socket.create_connection(srv.address, timeout=5) as s:
        s.sendall(REQ_MAGIC)  # a real start, then a byte at a time, each under the timeout
        dropped = False
        for _ in range(200):
            try:
                s.sendall(b"\x00")
            except OSError:
                dropped = True
                break
            time.sleep(0.1)
            if srv.stats().get("refused_truncated_or_io_error", 0):
                dropped = True
                break
        assert dropped
    assert read_ok(srv, rid)


def test_an_authenticated_connection_may_idle(server) -> None:
    srv, rid = server
    with TransferClient() as c:  # pooled: the same connection serves both reads
        out = bytearray(10)
        for _ in range(2):
            c.read(srv.address, issue_token(KEY, secrets.token_bytes(16), OP_READ, rid, [(0, 10)], ttl_s=10),
                   [(0, 10)], out)
            time.sleep(1.0)  # past header_timeout_s, under idle_timeout_s
        assert srv.stats().get("refused_header_timeout", 0) == 0
        assert srv.stats()["connections_total"] == 1
