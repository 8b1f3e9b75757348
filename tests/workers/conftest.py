from __future__ import annotations

import pathlib

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


MAX_MESSAGE_BYTES = 1 << 20  # small, so the oversize test sends only ~1.5 MB


@pytest.fixture(scope="session")
def worker(demo_model: str, key_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory):
    """One aggregated `pdcluster serve-worker` process shared by the tests of this folder."""
    from workers.worker_process import start_worker

    wp = start_worker(["--role", "both", "--model", demo_model, "--max-model-len", "256", "--key-dir", str(key_dir),
                       "--worker-id", "w-test", "--max-message-bytes", str(MAX_MESSAGE_BYTES)],
                      tmp_path_factory.mktemp("worker-logs"))
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
