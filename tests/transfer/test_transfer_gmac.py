"""AES-GMAC payload MACs (FLAG_GMAC): the wire format, tampering anywhere in a response, a replayed
response, the nonce source, a wrong key, and negotiation with a server that predates the flag."""

from __future__ import annotations

import pathlib
import secrets
import socket
import sys
import threading
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
from pdcluster.transfer import server as server_module
from pdcluster.transfer.gmac import NONCE_LEN, TAG_LEN, GmacSender, GmacWindow, new_nonce, window_key
from pdcluster.transfer.integrity import transfer_mac_key
from pdcluster.transfer.protocol import (
    FLAG_GMAC,
    FLAG_MAC,
    RESP_HEADER,
    STATUS_NAMES,
    pack_request,
    recv_exact,
)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from tamper_proxy import TamperProxy  # noqa: E402

KEY = secrets.token_bytes(32)
SIZE = 2 << 20
RANGES = [(8192 * i, 4096) for i in range(128)]  # 128 scattered ranges, 512 KiB
TOTAL = sum(n for _, n in RANGES)


@pytest.fixture(params=[True, False], ids=["single_use", "reusable"])
def served(request: pytest.FixtureRequest) -> Iterator[tuple[TransferServer, int, np.ndarray]]:
    region = alloc_region(SIZE)
    data = region.as_numpy()
    data[:] = np.random.default_rng(3).integers(0, 256, SIZE, dtype=np.uint8)
    srv = TransferServer(KEY, io_timeout_s=5.0, single_use=request.param).start()
    rid = srv.register(region)
    try:
        yield srv, rid, data
    finally:
        srv.stop()
        srv.unregister(rid)
        region.close()


def _grant(rid: int, ranges: list[tuple[int, int]] = RANGES) -> tuple[bytes, bytes]:
    token = issue_token(KEY, secrets.token_bytes(16), OP_READ, rid, ranges, ttl_s=30)
    return token, transfer_mac_key(KEY, token)


def _expected(data: np.ndarray) -> bytes:
    return b"".join(data[o:o + n].tobytes() for o, n in RANGES)


def _raw_gmac_read(addr: tuple[str, int], token: bytes, rid: int, client_nonce: bytes) -> tuple[int, bytes]:
    """One FLAG_GMAC request by hand: (status, everything after the response header)."""
    tid = token[8:24]
    frame = pack_request(OP_READ, rid, tid, token, RANGES, 0, TOTAL, FLAG_GMAC) + client_nonce
    with socket.create_connection(addr, timeout=5) as s:
        s.sendall(frame)
        hdr = memoryview(bytearray(RESP_HEADER.size))
        recv_exact(s, hdr)
        status = RESP_HEADER.unpack(hdr)[1]
        if status != 0:
            return status, b""
        rest = memoryview(bytearray(NONCE_LEN + TOTAL + TAG_LEN))
        recv_exact(s, rest)
        return status, bytes(hdr) + bytes(rest)


def test_wire_format_and_both_readers(served: tuple) -> None:
    srv, rid, data = served
    token, mac_key = _grant(rid)
    client_nonce = new_nonce()
    status, resp = _raw_gmac_read(srv.address, token, rid, client_nonce)
    assert status == 0
    body = resp[RESP_HEADER.size:]
    server_nonce, payload, tag = body[:NONCE_LEN], body[NONCE_LEN:-TAG_LEN], body[-TAG_LEN:]
    assert payload == _expected(data)
    mac = GmacWindow(mac_key, client_nonce, server_nonce, token[8:24], rid, 0, TOTAL)
    mac.update(payload)
    assert mac.digest() == tag
    from pdcluster.connectors.p2p.scatter_reader import ScatterReader

    with TransferClient(num_streams=3, min_stream_bytes=64 << 10) as client:
        out = bytearray(TOTAL)
        token, mac_key = _grant(rid)
        client.read(srv.address, token, RANGES, out, mac_key=mac_key)
        assert bytes(out) == _expected(data)
    reader = ScatterReader(num_streams=3, min_stream_bytes=64 << 10, io_timeout_s=5.0)
    try:
        dest = bytearray(TOTAL + 4096)
        token, mac_key = _grant(rid)
        reader.read(srv.address, token, RANGES, memoryview(dest), [(4096, TOTAL)], mac_key)
        assert bytes(dest[4096:]) == _expected(data)
    finally:
        reader.close()
    assert srv.stats().get("refused_total", 0) == 0


# Where a flipped byte lands in a one-stream response: header | server nonce | payload | tag.
@pytest.mark.parametrize("where", [RESP_HEADER.size + 3, RESP_HEADER.size + NONCE_LEN + 1000,
                                   RESP_HEADER.size + NONCE_LEN + TOTAL + 5],
                         ids=["server_nonce", "payload", "tag"])
def test_a_flipped_byte_anywhere_is_refused(served: tuple, where: int) -> None:
    srv, rid, _ = served
    proxy = TamperProxy(srv.address, flip_at=where)
    proxy.armed.set()
    try:
        with TransferClient(num_streams=1) as client, pytest.raises(TransferError) as info:
            token, mac_key = _grant(rid)
            client.read(proxy.address, token, RANGES, bytearray(TOTAL), mac_key=mac_key)
        assert info.value.status == "integrity" and proxy.flipped == 1
    finally:
        proxy.close()


def test_wrong_key_is_refused(served: tuple) -> None:
    srv, rid, _ = served
    token, _ = _grant(rid)
    with TransferClient() as client, pytest.raises(TransferError, match="integrity"):
        client.read(srv.address, token, RANGES, bytearray(TOTAL), mac_key=secrets.token_bytes(32))


class _Replayer:
    """A fake server that answers every request with one recorded response."""

    def __init__(self, response: bytes) -> None:
        self.response = response
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        with conn:
            conn.recv(1 << 16)  # the request (small: header, token, table, nonce)
            conn.sendall(self.response)
            try:
                conn.recv(1)
            except OSError:
                pass

    def close(self) -> None:
        self.listener.close()
        self.thread.join(5)


def test_a_replayed_response_is_refused() -> None:
    """A recorded response to an earlier request for the same window of the same token (older
    bytes, say) fails: its key came from another client nonce."""
    region = alloc_region(SIZE)
    srv = TransferServer(KEY, io_timeout_s=5.0).start()  # reusable tokens: the worst case
    rid = srv.register(region)
    try:
        token, mac_key = _grant(rid)
        status, recorded = _raw_gmac_read(srv.address, token, rid, new_nonce())
        assert status == 0
        fake = _Replayer(recorded)
        try:
            with TransferClient(num_streams=1) as client, pytest.raises(TransferError) as info:
                client.read(fake.listener.getsockname()[:2], token, RANGES, bytearray(TOTAL), mac_key=mac_key)
            assert info.value.status == "integrity"
        finally:
            fake.close()
    finally:
        srv.stop()
        srv.unregister(rid)
        region.close()


def test_the_server_never_reuses_a_window_key() -> None:
    """By construction the server draws its nonce itself, per response: even a client repeating
    its nonce for the same window (reusable token) gets a fresh key, IV and tag each time."""
    region = alloc_region(SIZE)
    srv = TransferServer(KEY, io_timeout_s=5.0).start()
    rid = srv.register(region)
    try:
        token, _ = _grant(rid)
        client_nonce = new_nonce()
        nonces, tags = set(), set()
        for _ in range(20):
            status, resp = _raw_gmac_read(srv.address, token, rid, client_nonce)
            assert status == 0
            nonces.add(resp[RESP_HEADER.size:RESP_HEADER.size + NONCE_LEN])
            tags.add(resp[-TAG_LEN:])
        assert len(nonces) == 20 and len(tags) == 20
    finally:
        srv.stop()
        srv.unregister(rid)
        region.close()


def test_nonce_source() -> None:
    mac_key, cn = secrets.token_bytes(32), new_nonce()
    senders = [GmacSender(mac_key, cn, b"t" * 16, 1, 0, 10) for _ in range(5000)]
    assert len({s.server_nonce for s in senders}) == 5000
    assert all(len(s.server_nonce) == NONCE_LEN for s in senders[:10])
    keys = {window_key(mac_key, cn, s.server_nonce) for s in senders}
    assert len(keys) == 5000
    # One object tags one message: nothing can be added after its tag.
    w = senders[0]
    w.update(b"abc")
    tag = w.digest()
    assert w.digest() == tag
    with pytest.raises(RuntimeError):
        w.update(b"more")
    with pytest.raises(ValueError):
        window_key(mac_key, cn[:8], cn)
    with pytest.raises(ValueError):
        GmacWindow(mac_key[:16], cn, cn, b"t" * 16, 1, 0, 10)


def test_context_binds_the_window() -> None:
    mac_key, cn, sn = secrets.token_bytes(32), new_nonce(), new_nonce()
    tags = set()
    for ctx in [(b"t" * 16, 1, 0, 10), (b"u" * 16, 1, 0, 10), (b"t" * 16, 2, 0, 10), (b"t" * 16, 1, 10, 10)]:
        w = GmacWindow(mac_key, cn, sn, *ctx)
        w.update(b"x" * 10)
        tags.add(w.digest())
    assert len(tags) == 4


def test_an_older_server_gets_blake3(served: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that predates FLAG_GMAC refuses it as bad_request: the reader asks again with
    FLAG_MAC (a refusal uses nothing of a single-use token) and keeps to it for that peer."""
    srv, rid, data = served
    monkeypatch.setattr(server_module, "MAC_FLAGS", (FLAG_MAC,))  # the old server's flag check
    with TransferClient(num_streams=2, min_stream_bytes=64 << 10) as client:
        for _ in range(2):
            out = bytearray(TOTAL)
            token, mac_key = _grant(rid)
            client.read(srv.address, token, RANGES, out, mac_key=mac_key)
            assert bytes(out) == _expected(data)
        assert client.macs.flags(srv.address, mac_key) == FLAG_MAC
    assert 1 <= srv.stats()["refused_bad_flags"] <= 2  # the first read's streams only


def test_blake3_on_request_and_gmac_write_refused(served: tuple) -> None:
    srv, rid, data = served
    with TransferClient(mac="blake3") as client:
        out = bytearray(TOTAL)
        token, mac_key = _grant(rid)
        client.read(srv.address, token, RANGES, out, mac_key=mac_key)
        assert bytes(out) == _expected(data)
    with pytest.raises(ValueError):
        TransferClient(mac="none")
    tid = secrets.token_bytes(16)
    wtoken = issue_token(KEY, tid, OP_WRITE, rid, [(0, 4096)], ttl_s=30)
    frame = pack_request(OP_WRITE, rid, tid, wtoken, [(0, 4096)], 0, 4096, flags=FLAG_GMAC)
    with socket.create_connection(srv.address, timeout=5) as s:
        s.sendall(frame + new_nonce())
        hdr = memoryview(bytearray(RESP_HEADER.size))
        recv_exact(s, hdr)
    assert STATUS_NAMES[RESP_HEADER.unpack(hdr)[1]] == "bad_request"
