"""cluster/ray_tls.py without Ray: the launcher's CA issues per-instance PEMs, the actor side
writes them privately, and a worker served from those files takes the router's channel and
refuses a plaintext peer."""

from __future__ import annotations

import os
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdcluster.cluster.ray_tls import (
    ENV_CA,
    ENV_CERT,
    ENV_KEY,
    LauncherTLS,
    router_worker_tls,
    split_env,
    write_identity,
)
from pdcluster.router.worker_client import _credentials
from pdcluster.security.pki import init_pki, load_identity
from pdcluster.security.rotation import dynamic_server_credentials
from pdcluster.worker.tls import channel_tls_options


@pytest.fixture
def worker_server(tmp_path):
    tls = LauncherTLS(None)
    rest, pems = split_env({"OTHER": "1", **tls.worker_env("both-0")})
    assert rest == {"OTHER": "1"} and pems is not None
    paths = write_identity(pems, parent=str(tmp_path))
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", dynamic_server_credentials(paths.cert, paths.key, paths.ca)[0])
    server.start()
    yield tls, paths, f"127.0.0.1:{port}"
    server.stop(0)
    paths.remove()


def _check(addr: str, creds: grpc.ChannelCredentials | None, options=()) -> int:
    with (grpc.secure_channel(addr, creds, options=list(options)) if creds else grpc.insecure_channel(addr)) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status


def test_identity_files_are_private(worker_server) -> None:
    _, paths, _ = worker_server
    assert os.stat(paths.folder).st_mode & 0o777 == 0o700
    assert os.stat(paths.key).st_mode & 0o777 == 0o600
    paths.remove()
    assert not os.path.exists(paths.folder)


def test_router_channel_in_plaintext_out(worker_server, tmp_path) -> None:
    tls, _, addr = worker_server
    _, router_pems = split_env(tls.router_env())
    router_paths = write_identity(router_pems, parent=str(tmp_path))
    cfg = router_worker_tls(router_paths)
    assert _check(addr, _credentials(cfg), channel_tls_options(cfg)) == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as e:
        _check(addr, None)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    # Another launcher's CA (another cluster) is refused too.
    _, other = split_env(LauncherTLS(None).router_env())
    other_cfg = router_worker_tls(write_identity(other, parent=str(tmp_path)))
    with pytest.raises(grpc.RpcError) as e:
        _check(addr, _credentials(other_cfg), channel_tls_options(other_cfg))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_key_dir_ca_is_used(tmp_path) -> None:
    ca = init_pki(tmp_path / "keys")
    tls = LauncherTLS(str(tmp_path / "keys"))
    env = tls.worker_env("prefill-0")
    assert env[ENV_CA] == open(ca.ca_path).read()
    assert "BEGIN" in env[ENV_CERT] and "PRIVATE KEY" in env[ENV_KEY]
    # Issued in memory: nothing is written into the user's folder.
    with pytest.raises(FileNotFoundError):
        load_identity(tmp_path / "keys", "prefill-0")
