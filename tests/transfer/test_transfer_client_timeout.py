"""TransferClient's I/O timeout is enforced by the kernel (SO_RCVTIMEO, blocking sockets with
MSG_WAITALL receives): a peer that never answers, or stalls in the middle of a payload, still
fails the read as TransferError("io") within about io_timeout_s, never hangs."""

from __future__ import annotations

import secrets
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from pdcluster.transfer import OP_READ, TransferClient, TransferError, issue_token
from pdcluster.transfer.protocol import REQ_FIXED_LEN, RESP_HEADER, RESP_MAGIC, ST_OK

KEY = secrets.token_bytes(32)


@pytest.fixture
def stalling_peer(request: pytest.FixtureRequest) -> Iterator[tuple[str, int]]:
    """Accepts, reads the request; 'silent': sends nothing; 'midway': an OK header and half the
    payload, then nothing. Holds the connection open until the test ends."""
    mode = request.param
    lsock = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()
    conns: list[socket.socket] = []

    def serve() -> None:
        conn, _ = lsock.accept()
        conns.append(conn)
        conn.recv(REQ_FIXED_LEN + 16)
        if mode == "midway":
            conn.sendall(RESP_HEADER.pack(RESP_MAGIC, ST_OK, 0, 0, 4096) + b"x" * 2048)
        done.wait(30)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield lsock.getsockname()
    finally:
        done.set()
        t.join(10)
        for c in conns:
            c.close()
        lsock.close()


@pytest.mark.parametrize("stalling_peer", ["silent", "midway"], indirect=True)
def test_a_stalled_read_times_out_as_io_error(stalling_peer: tuple[str, int]) -> None:
    ranges = [(0, 4096)]
    token = issue_token(KEY, secrets.token_bytes(16), OP_READ, 1, ranges, ttl_s=10)
    out = bytearray(4096)
    with TransferClient(io_timeout_s=0.5) as c:
        t0 = time.monotonic()
        with pytest.raises(TransferError) as err:
            c.read(stalling_peer, token, ranges, out)
        assert err.value.status == "io"
        assert time.monotonic() - t0 < 10  # the timeout, not forever
