"""Fixtures for connector tests: cluster keys and real engine processes on 127.0.0.1.

Every process a test starts is stopped by pid in the fixture's finalizer, pass or fail (and its
shared-memory segments removed if it was killed before it could unlink them)."""

from __future__ import annotations

import pathlib
import sys
from collections.abc import Iterator
from typing import Any

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # engine_proc, p2p_procs
from p2p_procs import ClusterKeys, EngineProc  # noqa: E402


@pytest.fixture(scope="session")
def cluster_keys() -> ClusterKeys:
    return ClusterKeys()


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from pdcluster.models.demo import ensure_demo_model

    return ensure_demo_model()


@pytest.fixture(scope="module")
def engine_procs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """start({name: engine_args}) -> {name: EngineProc}, started together and ready; every process
    is stopped at module end, by pid."""
    started: list[EngineProc] = []
    logs = tmp_path_factory.mktemp("engine-logs")

    def start(specs: dict[str, dict[str, Any]]) -> dict[str, EngineProc]:
        procs = {}
        for name, args in specs.items():
            procs[name] = EngineProc(args, logs / f"{name}.log")
            started.append(procs[name])
        return {name: p.wait_ready() for name, p in procs.items()}

    yield start
    for p in started:
        p.stop()
