"""A taken --http-port / --grpc-port is refused by name before any worker starts, in one line
(no traceback); the router's own bind failures (a port taken between the check and the bind)
name the port too."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys

import pytest

from pdcluster.cluster.router_cmd import check_port_free


@pytest.fixture
def taken_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_check_names_the_flag(taken_port) -> None:
    with pytest.raises(ValueError, match=f"--http-port {taken_port}: cannot listen on 127.0.0.1:{taken_port}"):
        check_port_free("127.0.0.1", taken_port, "--http-port")
    check_port_free("127.0.0.1", 0, "--http-port")  # 0 = a free one, -1 = disabled: nothing to check
    check_port_free("127.0.0.1", -1, "--http-port")
    with socket.socket() as s:  # a port nobody holds passes, and is left free
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    check_port_free("127.0.0.1", free, "--grpc-port")
    with pytest.raises(ValueError, match="--grpc-port"):
        check_port_free("192.0.2.1", free, "--grpc-port")  # TEST-NET: no address of this machine


@pytest.mark.parametrize("flag", ["--http-port", "--grpc-port"])
def test_serve_refuses_a_taken_port_before_starting_workers(taken_port, flag) -> None:
    other = "--grpc-port" if flag == "--http-port" else "--http-port"
    proc = subprocess.run([sys.executable, "-m", "pdcluster.cluster.cli", "serve", "--workers", "1",
                           flag, str(taken_port), other, "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"pdcluster serve: error: {flag} {taken_port}: cannot listen on 127.0.0.1:{taken_port}" in proc.stderr
    assert "Traceback" not in proc.stderr and "worker" not in proc.stderr  # nothing was started


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from pdcluster.models.demo import ensure_demo_model

    return ensure_demo_model(tmp_path_factory.mktemp("demo") / "model")


@pytest.mark.parametrize("which", ["grpc", "http"])
def test_router_bind_failures_name_the_port(taken_port, demo_model, which) -> None:
    """The check passed but the port was taken before the bind: the error still says which."""
    from pdcluster.router.app import Router
    from pdcluster.router.config import RouterConfig

    ports = {"grpc_port": taken_port, "http_port": 0} if which == "grpc" else {"grpc_port": 0, "http_port": taken_port}
    config = RouterConfig(model=demo_model, **ports)

    async def start() -> str:
        router = Router(config)
        try:
            await router.start()
        except OSError as e:
            return str(e)
        await router.stop()
        return ""

    message = asyncio.run(start())
    assert f"cannot bind the router's {which.upper() if which == 'http' else 'gRPC'} port" in message
    assert str(taken_port) in message


def test_vllm_flag_names_are_accepted() -> None:
    """A vLLM user types --port and --tensor-parallel-size / -tp; they mean --http-port and --tp."""
    from pdcluster.cluster.cli import build_parser

    p = build_parser()
    args = p.parse_args(["serve", "--port", "9000", "-tp", "2"])
    assert (args.http_port, args.tp) == (9000, 2)
    assert p.parse_args(["serve", "--tensor-parallel-size", "4"]).tp == 4
    assert p.parse_args(["router", "--workers", "127.0.0.1:1", "--port", "0"]).http_port == 0
    args = p.parse_args(["up", "--workers", "1", "--port", "7000", "--tensor-parallel-size", "2"])
    assert (args.http_port, args.tp) == (7000, 2)
