"""`pdcluster up --address ...` joins only a Ray cluster that enforces token authentication: the
check calls the GCS without a token (a stand-in gRPC server here plays an enforcing and an open
GCS), and refuses an open one, a missing token or a Ray without token auth unless --insecure."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from pdcluster.cluster import ray_auth, ray_head


class _AnyMethod(grpc.GenericRpcHandler):
    def __init__(self, enforce: bool) -> None:
        self.enforce = enforce

    def service(self, details):
        def handle(request, context):
            if self.enforce:
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "InvalidAuthToken")
            return b""

        return grpc.unary_unary_rpc_method_handler(handle)


@contextlib.contextmanager
def stand_in_gcs(enforce: bool) -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers([_AnyMethod(enforce)])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(0)


@pytest.fixture(params=[True, False], ids=["enforcing", "open"])
def gcs(request):
    with stand_in_gcs(request.param) as address:
        yield address, request.param


def test_gcs_auth_state(gcs) -> None:
    address, enforcing = gcs
    assert ray_auth.gcs_auth_state(address) == ("token" if enforcing else "open")
    assert ray_auth.gcs_auth_state("ray://10.0.0.1:10001") == "unknown"


def test_require_token_auth(gcs, monkeypatch, tmp_path) -> None:
    address, enforcing = gcs
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN", "t" * 32)
    if enforcing:
        assert "enforced" in ray_auth.require_token_auth(address, insecure=False)
        assert ray_auth.driver_auth_env() == {"RAY_AUTH_MODE": "token"}  # what the `up` CLI applies
        assert "RAY_AUTH_MODE" not in os.environ  # the caller's environment is never changed
    else:
        with pytest.raises(ValueError, match="--insecure"):
            ray_auth.require_token_auth(address, insecure=False)
        assert "NOT enforced" in ray_auth.require_token_auth(address, insecure=True)


def test_refusals_without_token_or_token_auth(gcs, monkeypatch, tmp_path) -> None:
    address, _ = gcs
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    with pytest.raises(ValueError, match="RAY_AUTH_TOKEN"):
        ray_auth.require_token_auth(address, insecure=False)
    assert ray_auth.driver_auth_env() == {}  # an explicit mode is the user's
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    with pytest.raises(ValueError, match="RAY_AUTH_MODE"):
        ray_auth.require_token_auth(address, insecure=False)
    assert ray_auth.driver_auth_env() == {} and os.environ["RAY_AUTH_MODE"] == "disabled"
    monkeypatch.setattr(ray_auth, "ray_has_token_auth", lambda: False)
    with pytest.raises(ValueError, match="no token authentication"):
        ray_auth.require_token_auth(address, insecure=False)
    assert "NOT available" in ray_auth.require_token_auth(address, insecure=True)


def test_up_refuses_an_open_cluster(tmp_path) -> None:
    env = {**os.environ, "RAY_AUTH_TOKEN": "t" * 32, "PDCLUSTER_STATE_DIR": str(tmp_path)}
    env.pop("RAY_AUTH_MODE", None)
    with stand_in_gcs(enforce=False) as address:
        r = subprocess.run([sys.executable, "-m", "pdcluster.cluster.cli", "up", "--address", address, "--workers",
                            "1"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and "without a token" in r.stderr and "--insecure" in r.stderr, r.stderr


def test_driver_env_is_scoped(monkeypatch) -> None:
    """A library caller's environment is its own: the head's settings hold only while the driver
    imports ray and joins, and what was there before comes back (absent stays absent)."""
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "1")
    env = {**ray_head.token_auth_env(), **ray_head.loopback_env()}
    with ray_head.driver_env(env):
        assert os.environ["RAY_AUTH_MODE"] == "token" and os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    assert "RAY_AUTH_MODE" not in os.environ and os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "1"
