from __future__ import annotations

import os
import pathlib
import signal

import pytest
import torch
from distributed.tp_procs import alive


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory):
    """(arch, **config overrides) -> path of a tiny float32 checkpoint saved by transformers."""
    from tiny_models import make_tiny_checkpoint

    cache: dict[tuple, str] = {}

    def get(arch: str, **overrides: int) -> str:
        key = (arch, *sorted(overrides.items()))
        if key not in cache:
            name = "-".join([arch, *(f"{k}{v}" for k, v in sorted(overrides.items()))])
            path = pathlib.Path(tmp_path_factory.mktemp(f"tp-{name}"))
            cache[key] = make_tiny_checkpoint(arch, path, dtype=torch.float32, **overrides)
        return cache[key]

    return get


@pytest.fixture
def started_pids():
    """Pids a test started (directly or as ranks of an engine it started): SIGKILLed by pid in the
    finalizer if still alive, whatever the outcome."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
