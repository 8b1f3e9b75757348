"""Router <-> worker gRPC under the cluster's mTLS identities (issue 16, items 1 and 2): a
plaintext peer and a certificate from another CA are refused at the handshake; a CA-signed
peer that is not the router may check health but not call Generate or Abort (PERMISSION_DENIED,
counted by method and role)."""

from __future__ import annotations

import asyncio
import pathlib

import grpc
import pytest

from pdcluster._proto import common_pb2, worker_pb2, worker_pb2_grpc
from pdcluster.security.pki import Identity, init_pki
from pdcluster.worker.tls import TLSConfig, channel_credentials


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Identity]:
    ca = init_pki(tmp_path_factory.mktemp("pki") / "cluster")
    other = init_pki(tmp_path_factory.mktemp("pki") / "other")
    return {"worker": ca.issue("worker", "w0"), "router": ca.issue("router", "r0"),
            "client": ca.issue("client", "c0"), "foreign": other.issue("router", "r0")}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):
    from pdcluster.config import EngineArgs
    from pdcluster.engine.async_engine import AsyncEngine
    from pdcluster.models.demo import ensure_demo_model

    model = str(ensure_demo_model(tmp_path_factory.mktemp("demo") / "model"))
    eng = AsyncEngine.from_engine_args(EngineArgs(model=model, max_model_len=256))
    try:
        yield eng
    finally:
        eng.shutdown()


def _creds(ident: Identity, ca: str) -> grpc.ChannelCredentials:
    return channel_credentials(TLSConfig(ca=ca, cert=ident.cert, key=ident.key))


async def _generate(port: int, creds: grpc.ChannelCredentials | None, request_id: str) -> list[int]:
    from grpc_health.v1 import health_pb2  # noqa: F401 -- the same import the servicer needs

    addr = f"127.0.0.1:{port}"
    async with (grpc.aio.secure_channel(addr, creds) if creds else grpc.aio.insecure_channel(addr)) as ch:
        request = worker_pb2.WorkerGenerateRequest(request_id=request_id, prompt_token_ids=[5, 6, 7, 8],
                                                   sampling_params=common_pb2.SamplingParams(max_tokens=3))
        out = []
        async for response in worker_pb2_grpc.WorkerStub(ch).Generate(request, timeout=30):
            out.extend(response.token_ids)
        return out


async def _health(port: int, creds: grpc.ChannelCredentials | None) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    addr = f"127.0.0.1:{port}"
    async with (grpc.aio.secure_channel(addr, creds) if creds else grpc.aio.insecure_channel(addr)) as ch:
        return (await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)).status


def test_only_the_router_identity_generates(engine, pki: dict[str, Identity]) -> None:
    from pdcluster.worker.server import start_worker_server

    w = pki["worker"]
    ca = w.ca

    async def main() -> None:
        server, port = await start_worker_server(engine, "both", tls=TLSConfig(cert=w.cert, key=w.key, ca=ca))
        try:
            assert await _generate(port, _creds(pki["router"], ca), "from-router")
            # Refused at the handshake: no TLS at all, and a router certificate of another CA.
            for creds in (None, _creds(pki["foreign"], pki["foreign"].ca)):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await _health(port, creds)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            # A CA-signed peer of another role: the handshake succeeds, Generate and Abort do not.
            client = _creds(pki["client"], ca)
            assert await _health(port, client) == 1  # SERVING
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await _generate(port, client, "from-client")
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
            async with grpc.aio.secure_channel(f"127.0.0.1:{port}", client) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await worker_pb2_grpc.WorkerStub(ch).Abort(common_pb2.AbortRequest(request_ids=["x"]), timeout=10)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert server.authz is not None
            assert server.authz.refusals["/pdcluster.v1.Worker/Generate:client"] == 1
            assert server.authz.refusals["/pdcluster.v1.Worker/Abort:client"] == 1
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_pki_files_are_private(tmp_path: pathlib.Path) -> None:
    ca = init_pki(tmp_path / "k", [("worker", "prefill-0")])
    tls = tmp_path / "k" / "tls"
    assert tls.stat().st_mode & 0o777 == 0o700
    assert (tls / "ca.key").stat().st_mode & 0o777 == 0o600
    assert (tls / "prefill-0").stat().st_mode & 0o777 == 0o700
    assert (tls / "prefill-0" / "key.pem").stat().st_mode & 0o777 == 0o600
    from cryptography import x509

    from pdcluster.security.pki import identity_of_cert

    cert = x509.load_pem_x509_certificate((tls / "prefill-0" / "cert.pem").read_bytes())
    assert identity_of_cert(cert) == ("worker", "prefill-0")
    with pytest.raises(FileExistsError):
        ca.issue("worker", "prefill-0")
