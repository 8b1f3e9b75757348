"""The router's HTTPS frontend follows its client-CA bundle (mutual TLS) without a restart
(router/tls_reload.HttpsCertReloader): a real aiohttp HTTPS server on 127.0.0.1, built as the
router builds it (app._ssl_context, reloader.install on the web.Server), and clients holding
certificates of two real CAs (pdcluster.security.pki). A CA added to the bundle is accepted, a
CA removed is refused, for full handshakes and for resumed TLS sessions, on one listening
socket that never restarts."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
from collections.abc import AsyncIterator, Iterator

import pytest
from aiohttp import web

from pdcluster.router.app import _ssl_context
from pdcluster.router.tls_reload import HttpsCertReloader
from pdcluster.security.pki import init_pki
from pdcluster.worker.tls import TLSConfig


def write_bundle(path, *pems: str) -> None:
    """Replace the bundle in one rename, as `keys rotate-ca` does."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        for pem in pems:
            f.write(open(pem, "rb").read())
    os.replace(tmp, path)


class Caller:
    """One client identity; keeps its SSLContext (a session resumes only on its own context)."""

    def __init__(self, ident, server_ca: str, max_version: ssl.TLSVersion) -> None:
        self.ctx = ssl.create_default_context(cafile=server_ca)
        self.ctx.check_hostname = False
        self.ctx.maximum_version = max_version
        self.ctx.load_cert_chain(ident.cert, ident.key)
        self.session: ssl.SSLSession | None = None

    def get(self, port: int, resume: bool = False) -> str:
        """"ok" (an HTTP answer to GET /health: the TLS peer was let in), "refused" (handshake or
        the first read failed); with resume, "ok-resumed" when the server let the old session in."""
        raw = socket.create_connection(("127.0.0.1", port), timeout=10)
        try:
            tls = self.ctx.wrap_socket(raw, server_hostname="router", session=self.session if resume else None)
            tls.sendall(b"GET /health HTTP/1.1\r\nHost: router\r\nConnection: close\r\n\r\n")
            data = b""
            while chunk := tls.recv(4096):  # to EOF: TLS 1.3 session tickets arrive after the handshake
                data += chunk
        except (ssl.SSLError, OSError):
            return "refused"
        finally:
            raw.close()
        if not data.startswith(b"HTTP/1.1 "):
            return "refused"
        reused = tls.session_reused
        self.session = tls.session
        return "ok-resumed" if resume and reused else "ok"


@pytest.fixture
def pki(tmp_path) -> Iterator[dict]:
    # Two CAs of two names: TLS stacks find the issuer by name (pki.begin_ca_rotation does the same)
    ca1, ca2 = init_pki(tmp_path / "ca1", common_name="CA-1"), init_pki(tmp_path / "ca2", common_name="CA-2")
    server = ca1.issue("router", "router")
    bundle = tmp_path / "client-ca.pem"
    write_bundle(bundle, ca1.issue("client", "c1").ca)
    yield {"server": server, "bundle": str(bundle), "c1": ca1.issue("client", "c1b"), "c2": ca2.issue("client", "c2")}


@contextlib.asynccontextmanager
async def _https_server(tls: TLSConfig) -> AsyncIterator[tuple[web.AppRunner, HttpsCertReloader, int]]:
    """A real aiohttp HTTPS server on 127.0.0.1 with the reloader installed: (runner, reloader, port)."""
    ctx = _ssl_context(tls)
    app = web.Application()
    app.router.add_get("/health", lambda r: web.Response(text="ok"))
    runner = web.AppRunner(app)
    await runner.setup()
    reloader = HttpsCertReloader(ctx, tls)
    reloader.install(runner.server)
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx)
    try:
        await site.start()
        yield runner, reloader, runner.addresses[0][1]
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("max_version", [ssl.TLSVersion.TLSv1_3, ssl.TLSVersion.TLSv1_2], ids=["tls1.3", "tls1.2"])
def test_client_ca_added_and_removed_without_restart(pki, max_version) -> None:
    server, bundle = pki["server"], pki["bundle"]
    ca1_pem, ca2_pem = pki["c1"].ca, pki["c2"].ca
    tls = TLSConfig(cert=server.cert, key=server.key, ca=bundle)
    c1 = Caller(pki["c1"], server.ca, max_version)
    c2 = Caller(pki["c2"], server.ca, max_version)

    async def run() -> None:
        async with _https_server(tls) as (runner, reloader, port):
            get = lambda caller, resume=False: asyncio.to_thread(caller.get, port, resume)  # noqa: E731
            assert await get(c1) == "ok"
            assert await get(c2) == "refused"  # CA-2 is not in the bundle
            assert not reloader.check()  # nothing changed

            write_bundle(bundle, ca1_pem, ca2_pem)
            assert reloader.check() and reloader.ca_reloads == 1
            assert await get(c2) == "ok"
            assert await get(c1) == "ok"
            # Resumption works while the client's CA is trusted (so the check below means something).
            assert await get(c1, resume=True) == "ok-resumed"

            write_bundle(bundle, ca2_pem)  # CA-1 removed
            assert reloader.check() and reloader.ca_reloads == 2
            assert await get(c1) == "refused"
            assert await get(c1, resume=True) == "refused"  # its old session does not get it back in
            assert reloader.resumed_refused == 1
            assert await get(c2) == "ok"
            assert await get(c2, resume=True) == "ok-resumed"  # a trusted CA's session still resumes
            assert runner.addresses[0][1] == port  # one listening socket throughout

    asyncio.run(run())


def test_unloadable_bundle_keeps_the_current_one(pki) -> None:
    """A bundle mid-write (empty, or not PEM) is not loaded: the CAs in force stay, and the
    next check after a good write takes it."""
    server, bundle = pki["server"], pki["bundle"]
    tls = TLSConfig(cert=server.cert, key=server.key, ca=bundle)
    c1 = Caller(pki["c1"], server.ca, ssl.TLSVersion.TLSv1_3)
    c2 = Caller(pki["c2"], server.ca, ssl.TLSVersion.TLSv1_3)

    async def run() -> None:
        async with _https_server(tls) as (runner, reloader, port):
            with open(f"{bundle}.tmp", "wb") as f:
                f.write(b"-----BEGIN CERTIFICATE-----\ntorn")
            os.replace(f"{bundle}.tmp", bundle)
            assert not reloader.check()
            assert await asyncio.to_thread(c1.get, port) == "ok"  # CA-1 still in force
            write_bundle(bundle, pki["c2"].ca)
            assert reloader.check()
            assert await asyncio.to_thread(c1.get, port) == "refused"
            assert await asyncio.to_thread(c2.get, port) == "ok"

    asyncio.run(run())


def test_router_https_frontend_follows_its_client_ca_bundle(pki, tmp_path) -> None:
    """The real Router (no workers, the demo model's tokenizer): its own reload loop (every
    health period) takes a changed bundle; polled with a deadline, never a sleep of a set length."""
    from pdcluster.models.demo import ensure_demo_model
    from pdcluster.router.app import Router
    from pdcluster.router.config import RouterConfig

    server, bundle = pki["server"], pki["bundle"]
    c1 = Caller(pki["c1"], server.ca, ssl.TLSVersion.TLSv1_3)
    c2 = Caller(pki["c2"], server.ca, ssl.TLSVersion.TLSv1_3)
    config = RouterConfig(model=ensure_demo_model(tmp_path / "demo"), host="127.0.0.1", grpc_port=0, http_port=0,
                          health_interval_s=0.1, tls=TLSConfig(cert=server.cert, key=server.key, ca=bundle))

    async def until(caller: Caller, want: str, port: int) -> str:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        got = await asyncio.to_thread(caller.get, port)
        while got != want and loop.time() < deadline:
            await asyncio.sleep(0.05)
            got = await asyncio.to_thread(caller.get, port)
        return got

    async def run() -> None:
        router = Router(config)
        await router.start()
        try:
            port = router.http_port
            assert await asyncio.to_thread(c1.get, port) == "ok"
            assert await asyncio.to_thread(c2.get, port) == "refused"
            write_bundle(bundle, pki["c1"].ca, pki["c2"].ca)
            assert await until(c2, "ok", port) == "ok"
            write_bundle(bundle, pki["c2"].ca)
            assert await until(c1, "refused", port) == "refused"
            assert await asyncio.to_thread(c2.get, port) == "ok"
            assert router.http_port == port
            scrape = router.metrics.render().decode()  # the reloads are on the router's /metrics
            assert 'pdcluster_router_https_reloads_total{what="client_ca"} 2.0' in scrape
            assert "pdcluster_router_https_resumed_refused_total 0.0" in scrape
        finally:
            await router.stop()

    asyncio.run(run())
