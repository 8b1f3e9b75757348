"""The router's worker channels follow its TLS files (issue 16, items 1/7): after a CA rotation
and revocation (`keys rotate-ca` reissues every instance, `keys revoke-ca` drops the old CA) a
channel built from the old files is refused by the worker, and the registry's probe rebuilds
the handle's channel from the current files, which the worker accepts; the old channel is
closed once idle. Also: the kvstore master's credentials follow their files."""

from __future__ import annotations

import asyncio
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdcluster.router.config import RouterConfig
from pdcluster.router.registry import WorkerRegistry
from pdcluster.security.pki import begin_ca_rotation, finish_ca_rotation, init_pki
from pdcluster.security.rotation import dynamic_server_credentials
from pdcluster.worker.tls import TLSConfig


def _server(cert: str, key: str, ca: str) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    servicer.set("pdcluster.v1.Worker", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", dynamic_server_credentials(cert, key, ca)[0])
    server.start()
    return server, f"127.0.0.1:{port}"


def _frozen_copy(tls: TLSConfig, folder) -> TLSConfig:
    """The router's files as they are now, copied: a channel 'built before the rotation'."""
    folder.mkdir()
    out = {}
    for name in ("ca", "cert", "key"):
        p = folder / name
        p.write_bytes(open(getattr(tls, name), "rb").read())
        out[name] = str(p)
    return TLSConfig(**out)


def test_channels_rebuilt_after_ca_rotation(tmp_path) -> None:
    ca = init_pki(tmp_path / "pki")
    w, r = ca.issue("worker", "w0"), ca.issue("router", "router")
    server, addr = _server(w.cert, w.key, w.ca)
    router_tls = TLSConfig(ca=r.ca, cert=r.cert, key=r.key)
    before = _frozen_copy(router_tls, tmp_path / "before")

    async def run() -> None:
        from pdcluster.router.worker_client import WorkerClient

        reg = WorkerRegistry(RouterConfig(workers=(addr,), worker_tls=router_tls))
        handle = reg.add(addr)
        assert await handle.client.check_health(10)
        assert not reg._tls.rebuild_if_changed(handle)  # nothing changed: same channel
        new_ca = begin_ca_rotation(tmp_path / "pki")
        new_ca.reissue("w0")
        new_ca.reissue("router")
        finish_ca_rotation(tmp_path / "pki")
        old = WorkerClient(addr, tls=before)  # a channel from the pre-rotation files: refused now
        assert not await old.check_health(10)
        await old.close()
        stale = handle.client
        assert reg._tls.rebuild_if_changed(handle) and handle.client is not stale
        assert await handle.client.check_health(10)  # a new handshake with the current files
        while reg._tls._retiring:  # the idle old channel is closed (its task ends)
            await asyncio.sleep(0.05)
        await reg.stop()

    try:
        asyncio.run(run())
    finally:
        server.stop(0)


def test_kvstore_master_credentials_follow_files(tmp_path) -> None:
    from pdcluster.kvstore.rpc import make_channel, server_credentials

    ca = init_pki(tmp_path / "pki")
    m, n = ca.issue("kvstore-master", "master"), ca.issue("kvstore-node", "n0")
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", server_credentials(m.cert, m.key, m.ca))
    server.start()
    addr = f"127.0.0.1:{port}"
    try:
        before = _frozen_copy(TLSConfig(ca=n.ca, cert=n.cert, key=n.key), tmp_path / "before")
        new_ca = begin_ca_rotation(tmp_path / "pki")
        for name in ("master", "n0"):
            new_ca.reissue(name)
        finish_ca_rotation(tmp_path / "pki")
        with make_channel(addr, tls_ca=before.ca, tls_cert=before.cert, tls_key=before.key) as ch:
            try:
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
                raise AssertionError("a certificate of the revoked CA was accepted")
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE
        with make_channel(addr, tls_ca=n.ca, tls_cert=n.cert, tls_key=n.key) as ch:
            assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status == 1
    finally:
        server.stop(0)


def test_https_certificate_reloaded_in_place(tmp_path) -> None:
    """The router's HTTPS context takes a reissued certificate for new handshakes (same
    listening socket); the served certificate's serial changes."""
    import ssl

    from aiohttp import web
    from cryptography import x509

    from pdcluster.router.app import _ssl_context
    from pdcluster.router.tls_reload import HttpsCertReloader

    ca = init_pki(tmp_path / "pki")
    ident = ca.issue("router", "router")
    tls = TLSConfig(cert=ident.cert, key=ident.key)

    async def run() -> None:
        ctx = _ssl_context(tls)
        app = web.Application()
        app.router.add_get("/health", lambda r: web.Response(text="ok"))
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx)
        await site.start()
        port = runner.addresses[0][1]

        async def served_serial() -> int:
            client = ssl.create_default_context(cafile=ident.ca)
            r, w = await asyncio.open_connection("127.0.0.1", port, ssl=client, server_hostname="127.0.0.1")
            der = w.get_extra_info("ssl_object").getpeercert(binary_form=True)
            w.close()
            return x509.load_der_x509_certificate(der).serial_number

        try:
            reloader = HttpsCertReloader(ctx, tls)
            first = await served_serial()
            assert not reloader.check()
            ca.reissue("router")
            assert reloader.check() and reloader.reloads == 1
            second = await served_serial()
            assert second != first
            assert second == x509.load_pem_x509_certificate(open(ident.cert, "rb").read()).serial_number
        finally:
            await runner.cleanup()

    asyncio.run(run())
