"""The data plane across real processes: TCP streams and the same-host shared-memory path."""

from __future__ import annotations

import glob
import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest

from pdcluster.transfer import (
    OP_READ,
    OP_WRITE,
    SharedRegionCache,
    TransferClient,
    TransferError,
    issue_token,
)
from pdcluster.transfer.region import shm_dir

KEY = secrets.token_bytes(32)
SIZE = 4 << 20
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def peer() -> Iterator[tuple[subprocess.Popen, dict]]:
    env = {**os.environ, "TEST_TRANSFER_KEY": KEY.hex()}
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "region_server_main.py"), str(SIZE)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
    try:
        info = json.loads(proc.stdout.readline())
        yield proc, info
    finally:
        if proc.poll() is None:
            proc.kill()  # by our own child's pid
        proc.wait(10)
        for path in glob.glob(os.path.join(shm_dir(), f"pdcluster-{proc.pid}-*")):
            os.unlink(path)  # a killed owner cannot unlink its segment


def expected(off: int, n: int) -> np.ndarray:
    return (np.arange(off, off + n, dtype=np.uint64) % 256).astype(np.uint8)


def test_tcp_streams_and_shm_path_between_processes(peer) -> None:
    proc, info = peer
    addr, rid = ("127.0.0.1", info["port"]), info["region_id"]
    ranges = [(100, 2 << 20), (3 << 20, 1 << 20)]
    total = sum(n for _, n in ranges)
    out = np.zeros(total, dtype=np.uint8)
    with TransferClient(num_streams=4, min_stream_bytes=256 << 10) as c:
        c.read(addr, issue_token(KEY, secrets.token_bytes(16), OP_READ, rid, ranges, ttl_s=10), ranges, out)
        assert np.array_equal(out, np.concatenate([expected(o, n) for o, n in ranges]))
        c.write(addr, issue_token(KEY, secrets.token_bytes(16), OP_WRITE, rid, [(0, 8)], ttl_s=10), [(0, 8)],
                b"ABCDEFGH")
        with pytest.raises(TransferError):
            c.read(addr, b"\0" * 104, [(0, 8)], bytearray(8))
    # Same host: map the peer's segment directly (the control plane told us its name).
    cache = SharedRegionCache()
    try:
        seg = cache.get(info["shm_name"], SIZE, writable=False)
        assert bytes(seg.view[:8]) == b"ABCDEFGH"  # the TCP write landed in the shared segment
        dst = np.zeros(1 << 20, dtype=np.uint8)
        np.copyto(dst, seg.as_numpy(np.uint8, (1 << 20,), offset=1 << 20))
        assert np.array_equal(dst, expected(1 << 20, 1 << 20))
    finally:
        cache.close()
    proc.stdin.close()
    assert proc.wait(10) == 0
    assert not os.path.exists(os.path.join(shm_dir(), info["shm_name"]))  # the owner unlinked it
