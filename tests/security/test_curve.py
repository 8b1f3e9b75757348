"""CURVE + ZAP: allowed clients get through; everyone else gets nothing and is counted."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from pdcluster.security.curve import (
    CurveAuthenticator,
    HandshakeMetrics,
    make_client_socket,
    make_server_socket,
    send_before,
)
from pdcluster.security.keys import generate_keypair

REFUSED_WINDOW_S = 0.6  # handshakes on loopback take milliseconds; this is a wide margin
DEADLINE_S = 5.0


def wait_for(cond: Callable[[], bool], timeout: float = DEADLINE_S) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def pump(pub: zmq.Socket, sub: zmq.Socket, duration: float, stop_at_first: bool = False) -> int:
    """Publish repeatedly for `duration` seconds; count what sub receives."""
    got = 0
    end = time.monotonic() + duration
    while time.monotonic() < end:
        pub.send(b"payload")
        while sub.poll(10):
            sub.recv()
            got += 1
        if got and stop_at_first:
            break
    return got


@pytest.fixture
def env():
    ctx = zmq.Context()
    registry = CollectorRegistry()
    auth = CurveAuthenticator(ctx, registry=registry, poll_interval_s=0.02).start()
    sockets: list[zmq.Socket] = []

    class Env:
        pass

    e = Env()
    e.ctx, e.auth, e.registry, e.sockets = ctx, auth, registry, sockets
    e.server, e.client, e.stranger = generate_keypair("router"), generate_keypair("client"), generate_keypair("stranger")

    def track(s: zmq.Socket) -> zmq.Socket:
        sockets.append(s)
        return s

    e.track = track
    yield e
    for s in sockets:
        s.close(linger=0)
    auth.stop()
    ctx.term()


def make_pub(e, allowed=None, name="events"):
    allowed = {"client": e.client.public} if allowed is None else allowed
    pub = e.track(make_server_socket(e.ctx, zmq.PUB, e.server, allowed, auth=e.auth, name=name))
    return pub, pub.last_endpoint.decode()


def make_sub(e, keypair, server_public, endpoint):
    sub = e.track(make_client_socket(e.ctx, zmq.SUB, keypair, server_public, endpoint))
    sub.subscribe(b"")
    return sub


def test_default_bind_is_loopback(env):
    _, endpoint = make_pub(env)
    assert endpoint.startswith("tcp://127.0.0.1:")


def test_allowed_client_receives(env):
    pub, ep = make_pub(env)
    sub = make_sub(env, env.client, env.server.public, ep)
    assert pump(pub, sub, DEADLINE_S, stop_at_first=True) > 0
    assert env.auth.metrics.value("events") == 0


def test_key_not_on_allow_list_refused_and_counted(env):
    pub, ep = make_pub(env)
    sub = make_sub(env, env.stranger, env.server.public, ep)
    assert pump(pub, sub, REFUSED_WINDOW_S) == 0
    assert wait_for(lambda: env.auth.metrics.value("events", "key_not_allowed") >= 1)


def test_wrong_server_key_refused_and_counted(env):
    pub, ep = make_pub(env)
    impostor = generate_keypair("impostor")  # client believes the server is someone else
    sub = make_sub(env, env.client, impostor.public, ep)
    assert pump(pub, sub, REFUSED_WINDOW_S) == 0
    assert wait_for(lambda: env.auth.metrics.value("events", "crypto") >= 1)


def test_plaintext_client_refused_and_counted(env):
    pub, ep = make_pub(env)
    sub = env.track(env.ctx.socket(zmq.SUB))
    sub.subscribe(b"")
    sub.connect(ep)
    assert pump(pub, sub, REFUSED_WINDOW_S) == 0
    assert wait_for(lambda: env.auth.metrics.value("events", "mechanism_mismatch") >= 1)


def test_empty_allow_list_fails_closed(env):
    pub, ep = make_pub(env, allowed={})
    sub = make_sub(env, env.client, env.server.public, ep)
    assert pump(pub, sub, REFUSED_WINDOW_S) == 0
    assert wait_for(lambda: env.auth.metrics.value("events", "no_allow_list") >= 1)


def test_stopped_authenticator_fails_closed(env):
    pub, ep = make_pub(env)
    env.auth.stop()  # no ZAP handler any more: ZAP_ENFORCE_DOMAIN makes libzmq refuse
    sub = make_sub(env, env.client, env.server.public, ep)
    assert pump(pub, sub, REFUSED_WINDOW_S) == 0
    with pytest.raises(RuntimeError, match="start the CurveAuthenticator"):
        make_server_socket(env.ctx, zmq.PUB, env.server, {"c": env.client.public}, auth=env.auth)


def test_set_allowed_admits_new_key_and_user_id_is_key_name(env):
    rep = env.track(
        make_server_socket(env.ctx, zmq.ROUTER, env.server, {"client": env.client.public}, auth=env.auth, name="rpc")
    )
    env.auth.set_allowed(rep, {"client": env.client.public, "stranger": env.stranger.public})
    dealer = env.track(make_client_socket(env.ctx, zmq.DEALER, env.stranger, env.server.public, rep.last_endpoint.decode()))
    dealer.send(b"hello")
    assert rep.poll(int(DEADLINE_S * 1000))
    ident, msg = rep.recv_multipart(copy=False)
    assert msg.bytes == b"hello"
    assert msg.get("User-Id") == "stranger"


def test_one_handshake_metrics_shared_between_authenticators():
    registry = CollectorRegistry()
    metrics = HandshakeMetrics(registry)
    ctx1, ctx2 = zmq.Context(), zmq.Context()
    try:
        a1 = CurveAuthenticator(ctx1, metrics=metrics).start()
        a2 = CurveAuthenticator(ctx2, metrics=metrics).start()
        with pytest.raises(zmq.ZMQError):  # one ZAP handler per context
            CurveAuthenticator(ctx1, metrics=metrics).start()
        a1.stop()
        a2.stop()
    finally:
        ctx1.term()
        ctx2.term()


def test_asyncio_context():
    async def main() -> bytes:
        ctx = zmq.asyncio.Context()
        server, client = generate_keypair("s"), generate_keypair("c")
        auth = CurveAuthenticator(ctx, poll_interval_s=0.02).start()
        rep = make_server_socket(ctx, zmq.ROUTER, server, [client.public], auth=auth)
        req = make_client_socket(ctx, zmq.DEALER, client, server.public, rep.last_endpoint.decode())
        try:
            await req.send(b"ping")
            ident, msg = await asyncio.wait_for(rep.recv_multipart(), DEADLINE_S)
            return msg
        finally:
            req.close(linger=0)
            rep.close(linger=0)
            auth.stop()
            ctx.term()

    assert asyncio.run(main()) == b"ping"


def test_send_before_gives_up_when_the_server_refused_the_handshake(env):
    """A DEALER whose key the server refused has no pipe: a plain send() would block for ever
    (the P2P consumer and the EC fetcher once hung on it). send_before returns False by its deadline."""
    router = env.track(make_server_socket(env.ctx, zmq.ROUTER, env.server, {"client": env.client.public},
                                          auth=env.auth, name="svc"))
    ep = router.last_endpoint.decode()
    refused = env.track(make_client_socket(env.ctx, zmq.DEALER, env.stranger, env.server.public, ep))
    assert wait_for(lambda: env.auth.metrics.value("svc", "key_not_allowed") >= 1)
    assert wait_for(lambda: not refused.poll(0, zmq.POLLOUT))  # the pipe is gone once refused
    assert send_before(refused, b"hello", time.monotonic() + 0.2) is False
    allowed = env.track(make_client_socket(env.ctx, zmq.DEALER, env.client, env.server.public, ep))
    assert send_before(allowed, b"hello", time.monotonic() + DEADLINE_S) is True
    assert router.poll(int(DEADLINE_S * 1000)) and router.recv_multipart()[1] == b"hello"
