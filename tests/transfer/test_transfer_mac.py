"""Data-plane integrity: payload MACs per READ window, single-use tokens, revocation by the issuer."""

from __future__ import annotations

import pathlib
import secrets
import socket
import sys
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
from pdcluster.transfer.integrity import transfer_mac_key
from pdcluster.transfer.protocol import FLAG_MAC, RESP_HEADER, STATUS_NAMES, pack_request, recv_exact

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from tamper_proxy import TamperProxy  # noqa: E402

KEY = secrets.token_bytes(32)
SIZE = 4 << 20


def _scatter_reader():  # noqa: ANN202 -- the connector's reader over the same protocol
    from pdcluster.connectors.p2p.scatter_reader import ScatterReader

    return ScatterReader(num_streams=3, min_stream_bytes=256 << 10, io_timeout_s=5.0)


@pytest.fixture
def served() -> Iterator[tuple[TransferServer, int, np.ndarray, list[str]]]:
    region = alloc_region(SIZE)
    data = region.as_numpy()
    data[:] = np.random.default_rng(1).integers(0, 256, SIZE, dtype=np.uint8)
    revoked: list[str] = []  # transfer ids (hex) the issuer ended
    srv = TransferServer(KEY, io_timeout_s=5.0, single_use=True,
                         authorize=lambda cap: "ended" if cap.transfer_id.hex() in revoked else None).start()
    rid = srv.register(region)
    try:
        yield srv, rid, data, revoked
    finally:
        srv.stop()
        srv.unregister(rid)
        region.close()


def _grant(rid: int, ranges: list[tuple[int, int]]) -> tuple[bytes, bytes]:
    token = issue_token(KEY, secrets.token_bytes(16), OP_READ, rid, ranges, ttl_s=30, serial=7)
    return token, transfer_mac_key(KEY, token)


RANGES = [(4096 * i * 3, 4096 * 2) for i in range(200)]  # scattered: 200 ranges, 1.6 MiB


def _expected(data: np.ndarray) -> bytes:
    return b"".join(data[o:o + n].tobytes() for o, n in RANGES)


def test_mac_checked_reads_deliver_the_bytes(served: tuple) -> None:
    srv, rid, data, _ = served
    total = sum(n for _, n in RANGES)
    token, mac_key = _grant(rid, RANGES)
    with TransferClient(num_streams=3, min_stream_bytes=256 << 10) as client:
        out = bytearray(total)
        client.read(srv.address, token, RANGES, out, mac_key=mac_key)
    assert bytes(out) == _expected(data)
    reader = _scatter_reader()
    try:
        token, mac_key = _grant(rid, RANGES)
        dest = bytearray(total + 8192)
        reader.read(srv.address, token, RANGES, memoryview(dest), [(8192, total)], mac_key)
        assert bytes(dest[8192:]) == _expected(data)
    finally:
        reader.close()


def test_a_byte_flipped_on_path_is_detected(served: tuple) -> None:
    srv, rid, data, _ = served
    total = sum(n for _, n in RANGES)
    proxy = TamperProxy(srv.address, flip_at=RESP_HEADER.size + 5000)
    reader = _scatter_reader()
    try:
        proxy.armed.set()
        token, mac_key = _grant(rid, RANGES)
        with pytest.raises(TransferError) as info:
            reader.read(proxy.address, token, RANGES, memoryview(bytearray(total)), [(0, total)], mac_key)
        assert info.value.status == "integrity" and proxy.flipped >= 1
        # Without a MAC the same attack goes unnoticed: what the check is for.
        token, _ = _grant(rid, RANGES)
        dest = bytearray(total)
        reader.read(proxy.address, token, RANGES, memoryview(dest), [(0, total)])
        assert bytes(dest) != _expected(data)
        # A MAC of the wrong key (e.g. one an attacker made up) is a mismatch as well.
        proxy.armed.clear()
        token, _ = _grant(rid, RANGES)
        with pytest.raises(TransferError, match="integrity"):
            reader.read(proxy.address, token, RANGES, memoryview(bytearray(total)), [(0, total)],
                        secrets.token_bytes(32))
    finally:
        reader.close()
        proxy.close()


def _raw_read(addr: tuple[str, int], frame: bytes) -> int:
    with socket.create_connection(addr, timeout=5) as s:
        s.sendall(frame)
        hdr = memoryview(bytearray(RESP_HEADER.size))
        recv_exact(s, hdr)
        return RESP_HEADER.unpack(hdr)[1]


def test_a_replayed_token_is_refused_and_counted(served: tuple) -> None:
    srv, rid, _, _ = served
    ranges = [(0, 65536)]
    tid = secrets.token_bytes(16)
    token = issue_token(KEY, tid, OP_READ, rid, ranges, ttl_s=30)
    frame = pack_request(OP_READ, rid, tid, token, ranges, 0, 65536)
    with TransferClient() as client:
        client.read(srv.address, token, ranges, bytearray(65536))
        with pytest.raises(TransferError) as info:  # the same window again
            client.read(srv.address, token, ranges, bytearray(65536))
    assert info.value.status == "replayed"
    half = pack_request(OP_READ, rid, tid, token, ranges, 4096, 4096)  # any overlap is a replay too
    assert STATUS_NAMES[_raw_read(srv.address, half)] == "replayed"
    assert STATUS_NAMES[_raw_read(srv.address, frame)] == "replayed"
    assert srv.stats()["refused_replayed"] == 3
    # Disjoint windows of one token (parallel streams) are each served once.
    tid2 = secrets.token_bytes(16)
    token2 = issue_token(KEY, tid2, OP_READ, rid, ranges, ttl_s=30)
    assert _raw_read(srv.address, pack_request(OP_READ, rid, tid2, token2, ranges, 0, 32768)) == 0
    assert _raw_read(srv.address, pack_request(OP_READ, rid, tid2, token2, ranges, 32768, 32768)) == 0


def test_a_token_dies_with_its_grant(served: tuple) -> None:
    srv, rid, _, revoked = served
    token, mac_key = _grant(rid, [(0, 8192)])
    revoked.append(token[8:24].hex())  # the token's transfer id: its lease ended
    with TransferClient() as client, pytest.raises(TransferError) as info:
        client.read(srv.address, token, [(0, 8192)], bytearray(8192), mac_key=mac_key)
    assert info.value.status == "revoked" and srv.stats()["refused_revoked"] == 1


def test_mac_flag_is_read_only(served: tuple) -> None:
    srv, rid, _, _ = served
    tid = secrets.token_bytes(16)
    token = issue_token(KEY, tid, OP_WRITE, rid, [(0, 4096)], ttl_s=30)
    frame = pack_request(OP_WRITE, rid, tid, token, [(0, 4096)], 0, 4096, flags=FLAG_MAC)
    assert STATUS_NAMES[_raw_read(srv.address, frame)] == "bad_request"
    assert srv.stats()["refused_bad_flags"] == 1
