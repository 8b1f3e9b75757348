"""Real store processes on 127.0.0.1 for the store connector tests; each is stopped by pid."""

from __future__ import annotations

import pathlib
import sys
from collections.abc import Iterator

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # store_engines

from pdcluster.cluster.store_procs import LocalStores, mooncake_master_binary
from pdcluster.connectors.store.mooncake_backend import mooncake_available


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStores]:
    s = LocalStores(str(tmp_path_factory.mktemp("stores")))
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def kvstore_master(stores: LocalStores) -> str:
    return stores.kvstore(node_size="64M")


def mooncake_skip_reason() -> str | None:
    why = mooncake_available()
    if why is None and mooncake_master_binary() is None:
        why = "mooncake_master binary not found"
    return why


@pytest.fixture(scope="module")
def mooncake_master(stores: LocalStores) -> str:
    why = mooncake_skip_reason()
    if why is not None:
        pytest.skip(f"Mooncake Store not installed here ({why}); pip install 'pdcluster[mooncake]'")
    return stores.mooncake(segment_bytes=64 << 20)
