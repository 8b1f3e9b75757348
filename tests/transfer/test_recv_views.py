"""protocol.recv_views: a gather receive fills every view in order, whatever pieces the kernel
hands back, past the iovec cap of one call, on blocking and on timeout sockets."""

from __future__ import annotations

import socket
import threading

import pytest

from pdcluster.transfer.protocol import _IOV_MAX, recv_views


@pytest.mark.parametrize("timeout", [None, 5.0])
def test_recv_views_fills_many_uneven_views_from_dribbled_sends(timeout: float | None) -> None:
    sizes = [(i * 37) % 301 for i in range(_IOV_MAX * 2 + 17)]  # zeros included, > 2 calls' worth
    payload = bytes(i % 251 for i in range(sum(sizes)))
    a, b = socket.socketpair()
    try:
        b.settimeout(timeout)

        def dribble() -> None:  # odd-sized sends that cut across view edges
            for off in range(0, len(payload), 997):
                a.sendall(payload[off:off + 997])

        sender = threading.Thread(target=dribble)
        sender.start()
        buf = bytearray(len(payload))
        views, off = [], 0
        for n in sizes:
            views.append(memoryview(buf)[off:off + n])
            off += n
        recv_views(b, views)
        sender.join()
        assert bytes(buf) == payload
    finally:
        a.close()
        b.close()


def test_recv_views_raises_when_the_peer_closes_early() -> None:
    a, b = socket.socketpair()
    try:
        a.sendall(b"x" * 10)
        a.close()
        with pytest.raises(ConnectionError):
            recv_views(b, [memoryview(bytearray(8)), memoryview(bytearray(8))])
    finally:
        b.close()
