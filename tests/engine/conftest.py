from __future__ import annotations

import pathlib

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_ckpts(tmp_path_factory: pytest.TempPathFactory):
    """arch -> path of a tiny random-weight checkpoint saved by transformers (built on first use)."""
    from tiny_models import make_tiny_checkpoint

    cache: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in cache:
            path = pathlib.Path(tmp_path_factory.mktemp(f"ckpt-{arch}"))
            cache[arch] = str(make_tiny_checkpoint(arch, path, dtype=torch.float32))
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from pdcluster.models.demo import ensure_demo_model

    return ensure_demo_model(tmp_path_factory.mktemp("demo") / "model")
