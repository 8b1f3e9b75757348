"""RangeIndex and the server's per-connection range-table cache (pdcluster/transfer/ranges.py),
and the P2P reader's handed-out windows: the same bytes and refusals as before, fewer Python
loops per request."""

from __future__ import annotations

import pathlib
import random
import secrets
import socket
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest

from pdcluster.connectors.p2p import scatter_reader
from pdcluster.connectors.p2p.scatter_reader import ScatterReader, plan_windows
from pdcluster.transfer import OP_READ, TransferError, TransferServer, alloc_region, issue_token
from pdcluster.transfer.client import split_windows
from pdcluster.transfer.integrity import transfer_mac_key
from pdcluster.transfer.protocol import (
    RANGE,
    RESP_HEADER,
    STATUS_NAMES,
    pack_request,
    recv_exact,
    window_segments,
)
from pdcluster.transfer.ranges import RangeIndex, TableCache
from pdcluster.transfer.tokens import ranges_digest, table_digest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from tamper_proxy import TamperProxy  # noqa: E402

KEY = secrets.token_bytes(32)
SIZE = 4 << 20


def test_window_equals_window_segments() -> None:
    rng = random.Random(7)
    for _ in range(300):
        ranges = [(rng.randrange(0, 1 << 20), rng.choice([0, 1, 7, 4096, rng.randrange(1, 9000)]))
                  for _ in range(rng.randrange(0, 40))]
        index = RangeIndex(ranges)
        total = sum(n for _, n in ranges)
        assert index.total == total
        for _ in range(20):
            start = rng.randrange(0, total + 2)
            length = rng.randrange(0, total - start + 3) if total >= start else 1
            assert index.window(start, length) == window_segments(ranges, start, length), (ranges, start, length)


def test_bounds_and_table_round_trip() -> None:
    ranges = [(100, 5), (0, 3), (4096, 1)]
    table = b"".join(RANGE.pack(o, n) for o, n in ranges)
    index = RangeIndex.from_table(table + b"nonce", len(ranges))
    assert index.ranges == ranges and index.total == 9 and index.max_end == 4097 and index.min_len == 1
    assert table_digest(len(ranges), table) == ranges_digest(ranges)
    assert RangeIndex([]).total == 0 and RangeIndex([]).window(0, 5) == []
    cache = TableCache()
    assert cache.get(b"k") is None
    cache.put(b"k", index)
    assert cache.get(b"k") is index and cache.get(b"k2") is None


def test_plan_windows_splits_only_big_transfers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scatter_reader, "CHUNKS_PER_STREAM", 2)
    assert plan_windows(8 << 20, 4, 1 << 20) == split_windows(8 << 20, 4, 1 << 20)  # small: as before
    big = plan_windows(128 << 20, 4, 1 << 20)
    assert len(big) == 8
    monkeypatch.setattr(scatter_reader, "CHUNKS_PER_STREAM", 1)
    assert plan_windows(128 << 20, 4, 1 << 20) == split_windows(128 << 20, 4, 1 << 20)  # the default
    assert sum(n for _, n in big) == 128 << 20 and [s for s, _ in big] == sorted(s for s, _ in big)
    assert all(s % 4096 == 0 for s, _ in big)


@pytest.fixture(params=[True, False], ids=["single_use", "reusable"])
def served(request: pytest.FixtureRequest) -> Iterator[tuple[TransferServer, int, np.ndarray]]:
    region = alloc_region(SIZE)
    data = region.as_numpy()
    data[:] = np.random.default_rng(5).integers(0, 256, SIZE, dtype=np.uint8)
    srv = TransferServer(KEY, io_timeout_s=5.0, single_use=request.param).start()
    rid = srv.register(region)
    try:
        yield srv, rid, data
    finally:
        srv.stop()
        srv.unregister(rid)
        region.close()


def _request(sock: socket.socket, token: bytes, rid: int, ranges: list[tuple[int, int]], start: int,
             length: int) -> tuple[int, bytes]:
    sock.sendall(pack_request(OP_READ, rid, token[8:24], token, ranges, start, length))
    hdr = memoryview(bytearray(RESP_HEADER.size))
    recv_exact(sock, hdr)
    status = RESP_HEADER.unpack(hdr)[1]
    if status:
        return status, b""
    out = memoryview(bytearray(length))
    recv_exact(sock, out)
    return status, bytes(out)


def test_cached_table_is_keyed_by_token_and_table(served: tuple) -> None:
    """Windows on one connection reuse the parsed table; another token, or the same token with
    another table, is checked afresh (wrong_ranges), never served from the cache."""
    srv, rid, data = served
    ranges = [(8192 * i, 4096) for i in range(64)]
    other = [(8192 * i + 4096, 4096) for i in range(64)]
    token = issue_token(KEY, secrets.token_bytes(16), OP_READ, rid, ranges, ttl_s=30)
    token2 = issue_token(KEY, secrets.token_bytes(16), OP_READ, rid, other, ttl_s=30)
    want = b"".join(data[o:o + n].tobytes() for o, n in ranges)
    want2 = b"".join(data[o:o + n].tobytes() for o, n in other)
    with socket.create_connection(srv.address, timeout=5) as s:
        assert _request(s, token, rid, ranges, 0, 10000) == (0, want[:10000])
        assert _request(s, token, rid, ranges, 10000, 50000) == (0, want[10000:60000])  # cache hit
        assert _request(s, token2, rid, other, 0, 4096) == (0, want2[:4096])  # another token
    with socket.create_connection(srv.address, timeout=5) as s:
        assert _request(s, token2, rid, other, 4096, 4096) == (0, want2[4096:8192])
        status, _ = _request(s, token2, rid, ranges, 8192, 4096)  # token2 with the first table
        assert STATUS_NAMES[status] == "unauthorized"
    assert srv.stats()["refused_wrong_ranges"] == 1


def test_handed_out_windows_read_right_bytes_once_each(served: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    srv, rid, data = served
    monkeypatch.setattr(scatter_reader, "CHUNK_MIN_BYTES", 64 << 10)
    monkeypatch.setattr(scatter_reader, "CHUNKS_PER_STREAM", 2)
    block = 16 << 10
    rng = random.Random(3)
    nblocks = SIZE // block
    src = [(b * block, block) for b in rng.sample(range(nblocks), 128)]  # 2 MiB, scattered
    dst_blocks = rng.sample(range(nblocks), 128)
    dst_ranges = [(b * block, block) for b in dst_blocks]
    token = issue_token(KEY, secrets.token_bytes(16), OP_READ, rid, src, ttl_s=30)
    dest = np.zeros(SIZE, dtype=np.uint8)
    reader = ScatterReader(num_streams=2, min_stream_bytes=64 << 10, io_timeout_s=5.0)
    try:
        before = srv.stats().get("requests_ok", 0)
        reader.read(srv.address, token, src, memoryview(dest), dst_ranges, transfer_mac_key(KEY, token))
        want = before + 4  # 2 streams x 2 windows each, taken as the streams free up
        deadline = time.monotonic() + 10  # the server counts a request just after its last byte left
        while srv.stats().get("requests_ok", 0) < want and time.monotonic() < deadline:
            time.sleep(0.01)
        assert srv.stats()["requests_ok"] == want
    finally:
        reader.close()
    for (so, n), (do, _) in zip(src, dst_ranges, strict=True):
        assert np.array_equal(dest[do:do + n], data[so:so + n])
    assert srv.stats().get("refused_total", 0) == 0


def test_tampered_handed_out_window_fails_the_read(served: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    srv, rid, _ = served
    monkeypatch.setattr(scatter_reader, "CHUNK_MIN_BYTES", 64 << 10)
    monkeypatch.setattr(scatter_reader, "CHUNKS_PER_STREAM", 2)
    src = [(i * 8192, 8192) for i in range(64)]  # 512 KiB: 4 windows of 128 KiB on 2 streams
    token = issue_token(KEY, secrets.token_bytes(16), OP_READ, rid, src, ttl_s=30)
    proxy = TamperProxy(srv.address, flip_at=RESP_HEADER.size + 16 + 5000)
    proxy.armed.set()
    reader = ScatterReader(num_streams=2, min_stream_bytes=64 << 10, io_timeout_s=5.0)
    try:
        dest = memoryview(bytearray(512 << 10))
        with pytest.raises(TransferError) as info:
            reader.read(proxy.address, token, src, dest, [(0, dest.nbytes)], transfer_mac_key(KEY, token))
        assert info.value.status == "integrity" and proxy.flipped >= 1
    finally:
        reader.close()
        proxy.close()
