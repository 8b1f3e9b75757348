"""The fault proxy itself, against a plain echo server: every mode does what it says, at the
moment it is armed, and close() leaves no listener, connection or thread behind."""

from __future__ import annotations

import contextlib
import os
import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest
from chaos.fault_proxy import FaultProxy
from proc_sockets import listening
from real_router_cluster import wait_until as wait_for


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        try:
            while data := self.request.recv(65536):
                self.request.sendall(data)
        except OSError:  # the proxy reset it: what the reset tests do
            pass


@contextlib.contextmanager
def _proxy() -> Iterator[FaultProxy]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    threads = {th.ident for th in threading.enumerate()}
    p = FaultProxy(server.server_address)
    try:
        yield p
    finally:
        port = p.address[1]
        p.close()
        server.shutdown()
        server.server_close()
        assert ("127.0.0.1", port) not in listening([os.getpid()])
        assert not [th for th in threading.enumerate() if th.name.startswith("fault-proxy") and th.ident not in threads]


@pytest.fixture
def proxy() -> Iterator[FaultProxy]:
    with _proxy() as p:
        yield p


def _conn(p: FaultProxy) -> socket.socket:
    s = socket.create_connection(p.address, timeout=10)
    s.settimeout(10)
    return s


def _echo(s: socket.socket, data: bytes) -> bytes:
    s.sendall(data)
    got = b""
    while len(got) < len(data):
        chunk = s.recv(65536)
        if not chunk:
            break
        got += chunk
    return got


@pytest.mark.slow
def test_pass_and_counters(proxy: FaultProxy) -> None:
    with _conn(proxy) as s:
        assert _echo(s, b"hello" * 100) == b"hello" * 100
    snap = proxy.snapshot()
    assert snap["forwarded"] == {"up": 500, "down": 500} and snap["connections"] == 1


@pytest.mark.slow
def test_corrupt_flips_one_byte_counted_from_arming(proxy: FaultProxy) -> None:
    with _conn(proxy) as s:
        assert _echo(s, b"a" * 10) == b"a" * 10
        proxy.corrupt("down", 3)
        got = _echo(s, b"b" * 10)
        assert got == b"bbb" + bytes([ord("b") ^ 0xFF]) + b"b" * 6
        assert _echo(s, b"c" * 10) == b"c" * 10  # once
    assert proxy.snapshot()["corrupted"] == 1


@pytest.mark.slow
def test_truncate_closes_after_n_bytes(proxy: FaultProxy) -> None:
    with _conn(proxy) as s:
        proxy.truncate("down", 4)
        s.sendall(b"x" * 10)
        got = b""
        while chunk := s.recv(100):
            got += chunk
        assert got == b"xxxx"  # then EOF
    assert proxy.snapshot()["truncated"] == 1
    with _conn(proxy) as s:  # once: the next connection passes
        assert _echo(s, b"ok") == b"ok"


def _is_cut(p: FaultProxy, s: socket.socket | None, data: bytes) -> bool:
    """True when this connection (a new one if s is None) is reset or closed by the proxy."""
    try:
        s = s or _conn(p)
        with s:
            s.sendall(data)
            return s.recv(10) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True


@pytest.mark.slow
def test_reset_sends_rst_and_refuses_new(proxy: FaultProxy) -> None:
    s = _conn(proxy)
    assert _echo(s, b"1") == b"1"
    proxy.reset()
    assert _is_cut(proxy, s, b"2")
    assert _is_cut(proxy, None, b"3")  # refused while armed
    assert proxy.snapshot()["resets"] >= 2
    proxy.clear()
    with _conn(proxy) as s:
        assert _echo(s, b"5") == b"5"


@pytest.mark.slow
def test_blackhole_reads_and_drops_then_clear_resets(proxy: FaultProxy) -> None:
    s = _conn(proxy)
    proxy.blackhole()
    s.sendall(b"lost")
    s.settimeout(0.3)
    with pytest.raises(socket.timeout):
        s.recv(10)
    assert wait_for(lambda: proxy.snapshot()["dropped"]["up"] == 4)
    proxy.clear()  # the stream lost bytes: it is reset, never resumed out of step
    s.settimeout(10)
    assert _is_cut(proxy, s, b"again")


@pytest.mark.slow
def test_delay_and_bandwidth(proxy: FaultProxy) -> None:
    with _conn(proxy) as s:
        proxy.delay(100)
        t0 = time.monotonic()
        assert _echo(s, b"d") == b"d"
        assert time.monotonic() - t0 >= 0.2  # 100 ms each way, at least
        proxy.bandwidth(20_000)
        t0 = time.monotonic()
        assert _echo(s, b"z" * 4096) == b"z" * 4096
        assert time.monotonic() - t0 >= 4096 / 20_000 * 0.9  # the two directions overlap


def test_smoke_every_mode_in_turn() -> None:
    """Default suite: every mode above, each on a fresh proxy and echo server (the separate tests
    are the slow suite's, for a clearer failure)."""
    for check in (test_pass_and_counters, test_corrupt_flips_one_byte_counted_from_arming,
                  test_truncate_closes_after_n_bytes, test_reset_sends_rst_and_refuses_new,
                  test_blackhole_reads_and_drops_then_clear_resets, test_delay_and_bandwidth):
        with _proxy() as p:
            check(p)



@pytest.mark.slow
def test_corrupt_after_flips_one_bit_after_a_marker(proxy: FaultProxy) -> None:
    with _conn(proxy) as s:
        proxy.corrupt_after("down", b"rid-7", 2)
        assert _echo(s, b"xx") == b"xx"  # no marker: passes, still armed
        assert _echo(s, b"..rid-7:\x12\x05tail") == b"..rid-7:\x12\x04tail"  # 5 ^ 1 = 4
        assert _echo(s, b"rid-7:\x12\x05") == b"rid-7:\x12\x05"  # once
    assert proxy.snapshot()["corrupted"] == 1
