"""TransferServer + TransferClient over real sockets on 127.0.0.1 (server threads in this process)."""

from __future__ import annotations

import secrets
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from pdcluster.transfer import (
    OP_READ,
    OP_WRITE,
    TransferClient,
    TransferError,
    TransferServer,
    alloc_region,
    issue_token,
)
from pdcluster.transfer.protocol import REQ_FIXED_LEN, RESP_HEADER, pack_request
from pdcluster.transfer.tokens import now_ms

KEY = secrets.token_bytes(32)
SIZE = 8 << 20


@pytest.fixture
def server() -> Iterator[tuple[TransferServer, int, np.ndarray]]:
    region = alloc_region(SIZE, shared=True)
    data = region.as_numpy()
    data[:] = np.random.default_rng(0).integers(0, 256, SIZE, dtype=np.uint8)
    srv = TransferServer(KEY, max_ranges=64, max_request_bytes=SIZE, io_timeout_s=1.0).start()
    rid = srv.register(region)
    try:
        yield srv, rid, data
    finally:
        srv.stop()
        srv.unregister(rid)
        region.close()


def tok(op: int, rid: int, ranges: list[tuple[int, int]], tid: bytes | None = None, ttl: float = 10) -> bytes:
    return issue_token(KEY, tid or secrets.token_bytes(16), op, rid, ranges, ttl_s=ttl)


def frame_for(op: int, rid: int, ranges: list[tuple[int, int]]) -> bytes:
    """A well-formed request frame with a valid token for the whole of `ranges`."""
    tid = secrets.token_bytes(16)
    return pack_request(op, rid, tid, tok(op, rid, ranges, tid=tid), ranges, 0, sum(n for _, n in ranges))


def good_read(srv: TransferServer, rid: int, data: np.ndarray) -> None:
    """The server still serves a well-behaved client."""
    out = bytearray(1000)
    with TransferClient() as c:
        c.read(srv.address, tok(OP_READ, rid, [(5, 1000)]), [(5, 1000)], out)
    assert bytes(out) == data[5:1005].tobytes()


@pytest.mark.parametrize("num_streams", [1, 4])
def test_read_write_roundtrip_multi_range(server, num_streams: int) -> None:
    srv, rid, data = server
    ranges = [(0, 1 << 20), (3 << 20, 3 << 20), (7 << 20, 4096)]
    total = sum(n for _, n in ranges)
    with TransferClient(num_streams=num_streams, min_stream_bytes=256 << 10) as c:
        out = np.zeros(total, dtype=np.uint8)
        assert c.read(srv.address, tok(OP_READ, rid, ranges), ranges, out) == total
        expect = np.concatenate([data[o:o + n] for o, n in ranges])
        assert np.array_equal(out, expect)
        src = np.random.default_rng(1).integers(0, 256, total, dtype=np.uint8)
        c.write(srv.address, tok(OP_WRITE, rid, ranges), ranges, src)
        assert np.array_equal(np.concatenate([data[o:o + n] for o, n in ranges]), src)
    if num_streams > 1:
        assert srv.stats()["connections_total"] >= 2  # really several streams


def test_connections_are_reused_across_transfers(server) -> None:
    srv, rid, data = server
    with TransferClient(num_streams=1) as c:
        for i in range(20):
            out = bytearray(64)
            c.read(srv.address, tok(OP_READ, rid, [(i * 64, 64)]), [(i * 64, 64)], out)
            assert bytes(out) == data[i * 64:(i + 1) * 64].tobytes()
    assert srv.stats()["connections_total"] == 1


def refused(srv: TransferServer, reason: str) -> int:
    return srv.stats().get(f"refused_{reason}", 0)


def test_bad_tokens_are_refused_and_counted(server) -> None:
    srv, rid, data = server
    r = [(0, 4096)]
    out = bytearray(8192)
    tid = secrets.token_bytes(16)
    cases = [
        (issue_token(secrets.token_bytes(32), tid, OP_READ, rid, r, ttl_s=10), r, "bad_mac"),  # forged
        (issue_token(KEY, tid, OP_READ, rid, r, expiry_ms=now_ms() - 5), r, "expired"),  # replay after expiry
        (tok(OP_READ, rid + 1, r), r, "no_region"),
        (tok(OP_READ, rid, [(0, 4095)]), r, "wrong_ranges"),
        (tok(OP_READ, rid, [(4096, 4096)]), [(4096, 4096)], None),  # good, control
    ]
    with TransferClient() as c:
        for token, ranges, reason in cases:
            if reason is None:
                c.read(srv.address, token, ranges, out)
                continue
            before = refused(srv, reason)
            with pytest.raises(TransferError):
                c.read(srv.address, token, ranges, out)
            assert refused(srv, reason) == before + 1
        with pytest.raises(TransferError):  # a READ token used for WRITE
            c.write(srv.address, tok(OP_READ, rid, r), r, out)
    good_read(srv, rid, data)


def raw_exchange(addr: tuple[str, int], payload: bytes, half_close: bool = True) -> bytes:
    """Send raw bytes, return whatever comes back before the server closes (it may reset)."""
    chunks = []
    with socket.create_connection(addr, timeout=5) as s:
        try:
            s.sendall(payload)
            if half_close:
                s.shutdown(socket.SHUT_WR)
            while chunk := s.recv(65536):
                chunks.append(chunk)
        except (ConnectionResetError, BrokenPipeError, OSError):
            pass
    return b"".join(chunks)


def test_token_for_another_transfer_or_region_is_refused(server) -> None:
    srv, rid, data = server
    other = alloc_region(4096)
    oid = srv.register(other)
    r = [(0, 4096)]
    tid = secrets.token_bytes(16)
    token = tok(OP_READ, rid, r, tid=tid)
    for header_tid, header_rid, reason in ((secrets.token_bytes(16), rid, "wrong_transfer"),
                                           (tid, oid, "wrong_region")):
        reply = raw_exchange(srv.address, pack_request(OP_READ, header_rid, header_tid, token, r, 0, 4096))
        # A refusal status, or nothing (the unread range table may turn the close into a reset).
        assert reply == b"" or (len(reply) == RESP_HEADER.size and RESP_HEADER.unpack(reply)[1] != 0)
        assert refused(srv, reason) == 1
    wtoken = tok(OP_WRITE, rid, r, tid=tid)  # a WRITE token presented for a READ
    raw_exchange(srv.address, pack_request(OP_READ, rid, tid, wtoken, r, 0, 4096))
    assert refused(srv, "wrong_op") == 1
    srv.unregister(oid)
    other.close()
    good_read(srv, rid, data)


def test_garbage_probe_truncated_and_oversize_frames(server) -> None:
    srv, rid, data = server
    raw_exchange(srv.address, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    raw_exchange(srv.address, secrets.token_bytes(4096))
    t0 = time.monotonic()
    raw_exchange(srv.address, b"\x16\x03\x01", half_close=False)  # TLS-ish probe, then silence
    assert time.monotonic() - t0 < 5  # io_timeout, not forever
    r = [(0, 4096)]
    frame = frame_for(OP_READ, rid, r)
    raw_exchange(srv.address, frame[:REQ_FIXED_LEN - 10])  # truncated header
    raw_exchange(srv.address, frame[:-5])  # truncated range table
    many = [(i, 1) for i in range(65)]  # over max_ranges=64: refused before reading the table
    raw_exchange(srv.address, frame_for(OP_READ, rid, many))
    huge = [(0, SIZE * 4)]  # over max_request_bytes
    raw_exchange(srv.address, frame_for(OP_READ, rid, huge))
    oob = [(SIZE - 10, 20)]  # a valid token for bytes past the region's end
    with TransferClient() as c, pytest.raises(TransferError, match="out_of_range"):
        c.read(srv.address, tok(OP_READ, rid, oob), oob, bytearray(20))
    st = srv.stats()
    assert st["refused_bad_magic"] >= 2
    assert st["refused_truncated_or_io_error"] >= 3, st
    assert st["refused_too_many_ranges"] == 1 and st["refused_request_too_large"] == 1
    assert st["refused_out_of_range"] == 1
    assert st.get("refused_wrong_transfer", 0) == 0
    good_read(srv, rid, data)


def test_many_concurrent_clients(server) -> None:
    srv, rid, data = server
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            with TransferClient(num_streams=2, min_stream_bytes=64 << 10) as c:
                r = [(i * 200_000, 150_000)]
                out = np.zeros(150_000, dtype=np.uint8)
                c.read(srv.address, tok(OP_READ, rid, r), r, out)
                assert np.array_equal(out, data[i * 200_000:i * 200_000 + 150_000])
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_unknown_region_and_unregister(server) -> None:
    srv, rid, data = server
    extra = alloc_region(4096)
    xid = srv.register(extra)
    with TransferClient() as c:
        c.read(srv.address, tok(OP_READ, xid, [(0, 16)]), [(0, 16)], bytearray(16))
        srv.unregister(xid)
        with pytest.raises(TransferError, match="no_region"):
            c.read(srv.address, tok(OP_READ, xid, [(0, 16)]), [(0, 16)], bytearray(16))
    good_read(srv, rid, data)
