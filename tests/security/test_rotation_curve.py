"""CURVE key rotation without a restart (issue 16 item 7): `keys rotate` puts NAME.next beside
NAME, the server's allow-list follows the key folder (KeyDirWatcher), both keys are served while
clients move over, `keys revoke` removes the old key: a new session with it is refused and
counted, and what a live session of the revoked key still sends is dropped
(session_allowed). No step waits a fixed time: each waits for its condition."""

from __future__ import annotations

import pathlib
import time

import pytest
import zmq

from pdcluster.security.curve import CurveAuthenticator, make_client_socket, make_server_socket
from pdcluster.security.keys import KeyPair, init_keys, load_keypair, revoke_old_key, rotate_key
from pdcluster.security.rotation import KeyDirWatcher

DEADLINE_S = 60.0  # only bounds a hang; every wait ends as soon as its condition holds


@pytest.fixture()
def setup(tmp_path: pathlib.Path):
    keys = tmp_path / "keys"
    init_keys(keys, ["server", "worker"])
    ctx = zmq.Context()
    auth = CurveAuthenticator(ctx).start()
    server_kp = load_keypair(keys, "server")
    sock = make_server_socket(ctx, zmq.ROUTER, server_kp, {"placeholder": server_kp.public}, auth=auth, name="rpc")
    watcher = KeyDirWatcher(auth, {sock: keys})
    watcher.reload()
    clients: list[zmq.Socket] = []

    def client(name: str | KeyPair) -> zmq.Socket:
        kp = load_keypair(keys, name) if isinstance(name, str) else name
        c = make_client_socket(ctx, zmq.DEALER, kp, server_kp.public, sock.last_endpoint.decode())
        clients.append(c)
        return c

    try:
        yield keys, auth, sock, watcher, client
    finally:
        watcher.stop()
        for c in clients:
            c.close()
        sock.close()
        auth.stop()
        ctx.term()


def _serve_one(auth: CurveAuthenticator, sock: zmq.Socket) -> tuple[bytes, str, bool]:
    """Receive one request; reply only when its session's key is still allowed."""
    assert sock.poll(int(DEADLINE_S * 1000)), "no message arrived"
    ident, body = sock.recv_multipart(copy=False)
    allowed = auth.session_allowed(sock, body)
    if allowed:
        sock.send_multipart([ident.bytes, b"ok:" + body.bytes])
    return body.bytes, body.get("User-Id"), allowed


def _round_trip(auth, sock, c: zmq.Socket, payload: bytes) -> str:
    c.send(payload)
    body, user, allowed = _serve_one(auth, sock)
    assert body == payload and allowed
    assert c.poll(int(DEADLINE_S * 1000)) and c.recv() == b"ok:" + payload
    return user


def test_rotate_then_revoke(setup) -> None:
    keys, auth, sock, watcher, client = setup
    old_pair = load_keypair(keys, "worker")
    old = client(old_pair)
    assert _round_trip(auth, sock, old, b"before") == "worker"

    rotate_key(keys, "worker")
    assert watcher.reload(force=False) == {sock.zap_domain.decode(): []}  # added, none revoked
    new = client("worker.next")
    # Both sessions are served while clients move over; the new key keeps the User-Id.
    for i in range(20):
        assert _round_trip(auth, sock, old, b"old%d" % i) == "worker"
        assert _round_trip(auth, sock, new, b"new%d" % i) == "worker"

    revoke_old_key(keys, "worker")
    assert watcher.reload(force=False) == {sock.zap_domain.decode(): ["worker"]}
    assert _round_trip(auth, sock, new, b"after") == "worker"  # the live new session goes on
    # The live session of the revoked key: its messages arrive but are not served.
    old.send(b"stale")
    body, _, allowed = _serve_one(auth, sock)
    assert body == b"stale" and not allowed
    # A new session with the revoked key is refused at the handshake and counted.
    before = auth.metrics.value("rpc", "key_not_allowed")
    stale = client(old_pair)
    stale.send(b"again")
    end = time.monotonic() + DEADLINE_S
    while auth.metrics.value("rpc", "key_not_allowed") <= before and time.monotonic() < end:
        time.sleep(0.01)
    assert auth.metrics.value("rpc", "key_not_allowed") > before
    assert not sock.poll(0)  # nothing of the refused session reached the server


def test_watcher_polls_the_folder(setup) -> None:
    keys, auth, sock, watcher, client = setup
    watcher._poll_s = 0.02  # the folder stat poll; the wait below ends when it has run
    watcher.start()
    applied = watcher.applied
    rotate_key(keys, "worker")
    end = time.monotonic() + DEADLINE_S
    while watcher.applied == applied and time.monotonic() < end:  # the poll saw the new file
        time.sleep(0.01)
    assert watcher.applied > applied
    new = client("worker.next")
    new.send(b"hello")
    body, user, allowed = _serve_one(auth, sock)
    assert (body, user, allowed) == (b"hello", "worker", True)


def test_sighup_reloads(setup) -> None:
    import os
    import signal

    from pdcluster.security.rotation import reload_on_sighup

    keys, auth, sock, watcher, client = setup
    applied = watcher.applied
    restore = reload_on_sighup(watcher)
    try:
        rotate_key(keys, "worker")
        os.kill(os.getpid(), signal.SIGHUP)
        end = time.monotonic() + DEADLINE_S
        while watcher.applied == applied and time.monotonic() < end:
            time.sleep(0.01)
        assert watcher.applied > applied
    finally:
        restore()
    assert _round_trip(auth, sock, client("worker.next"), b"hup") == "worker"
