from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from pdcluster.models.demo import ensure_demo_model

    return str(ensure_demo_model(tmp_path_factory.mktemp("demo") / "model"))


@pytest.fixture(scope="session")
def key_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Cluster keys: `router` may subscribe to KV events (the worker's default allow-list);
    `client` exists but is not allowed."""
    from pdcluster.security.keys import init_keys

    root = tmp_path_factory.mktemp("keys") / "cluster"
    init_keys(root, ("router", "worker", "client"))
    return root


@pytest.fixture(scope="module")
def engine(demo_model: str):
    """One real AsyncEngine (max_model_len 256) per test module that asks for it; every test
    leaves it idle."""
    from pdcluster.config import EngineArgs
    from pdcluster.engine.async_engine import AsyncEngine

    eng = AsyncEngine.from_engine_args(EngineArgs(model=demo_model, max_model_len=256))
    try:
        yield eng
    finally:
        eng.shutdown()


MAX_MESSAGE_BYTES = 1 << 20  # small, so the oversize test sends only ~1.5 MB


@pytest.fixture(scope="session")
def worker(demo_model: str, key_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory):
    """One aggregated `pdcluster serve-worker` process shared by the tests of this folder."""
    from workers.worker_process import start_worker

    wp = start_worker(["--role", "both", "--model", demo_model, "--max-model-len", "256", "--key-dir", str(key_dir),
                       "--worker-id", "w-test", "--max-message-bytes", str(MAX_MESSAGE_BYTES)],
                      tmp_path_factory.mktemp("worker-logs"), hold=True)  # ids "held-...": see engine_hold.py
    try:
        yield wp
    finally:
        wp.stop()


@pytest.fixture(scope="session")
def stub(worker):
    import grpc

    from pdcluster._proto import worker_pb2_grpc

    channel = grpc.insecure_channel(worker.address)
    try:
        yield worker_pb2_grpc.WorkerStub(channel)
    finally:
        channel.close()


def _openssl(*args: str, cwd: pathlib.Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    d = tmp_path_factory.mktemp("certs")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=test-ca", cwd=d)
    # The identity carries the role (pdcluster/security/pki.py): under mTLS a worker takes
    # Generate/Abort only from a router's certificate, so the client certificate is a router's.
    for name, role in (("server", "worker"), ("client", "router")):
        (d / f"{name}.ext").write_text(f"subjectAltName=DNS:localhost,IP:127.0.0.1,URI:spiffe://pdcluster/{role}/{name}\n")
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)
    return d
