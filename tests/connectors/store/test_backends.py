"""Both store backends against real servers: the same keys, buffers and outcomes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from pdcluster.connectors.store.backend import PutResult, StoreBackend
from pdcluster.connectors.store.backend_factory import make_backend
from pdcluster.connectors.store.layout import StoreLayout

LAYOUT = StoreLayout(model_id="m", num_layers=2, total_num_kv_heads=2, head_dim=8, block_size=4,
                     kv_dtype="float32", itemsize=4, store_tp_size=2)


@pytest.fixture(params=["kvstore", "mooncake"])
def backend(request: pytest.FixtureRequest) -> Iterator[StoreBackend]:
    if request.param == "kvstore":
        b = make_backend("kvstore", {"master": request.getfixturevalue("kvstore_master")})
    else:
        b = make_backend("mooncake", {"mooncake_master": request.getfixturevalue("mooncake_master")})
    try:
        yield b
    finally:
        b.close()


def test_put_exists_get_remove(backend: StoreBackend, request: pytest.FixtureRequest) -> None:
    n = LAYOUT.object_nbytes
    src = torch.randint(0, 255, (3, n), dtype=torch.uint8)
    dst = torch.zeros(3, n, dtype=torch.uint8)
    for buf in (src, dst):
        backend.register_buffer(buf)
    keys = [LAYOUT.key(i % 2, bytes([i]) * 32) for i in range(3)]
    keys = [f"{k}-{backend.name}" for k in keys]  # one store process serves several tests
    assert backend.batch_exists(keys) == [False] * 3
    assert backend.batch_put_from(keys[:2], list(src[:2].unbind(0))) == [PutResult.STORED] * 2
    assert backend.batch_exists(keys) == [True, True, False]
    # Immutable: a second put of a key leaves the first bytes.
    again = backend.batch_put_from(keys[:1], [dst[0]])
    assert again[0] in (PutResult.EXISTS, PutResult.STORED)
    assert backend.batch_get_into(keys, list(dst.unbind(0))) == [True, True, False]
    assert torch.equal(dst[:2], src[:2])
    # A buffer of the wrong size is a miss, never partial data reported good.
    small = torch.zeros(n // 2, dtype=torch.uint8)
    backend.register_buffer(small)
    assert backend.batch_get_into(keys[:1], [small]) == [False]
    assert backend.remove(keys[:1]) == [True]
    assert backend.batch_exists(keys[:2]) == [False, True]
    for buf in (src, dst, small):
        backend.unregister_buffer(buf)


def test_many_keys_in_one_call(backend: StoreBackend) -> None:
    keys = [f"bulk-{backend.name}-{i}" for i in range(3000)]  # beyond one kvstore RPC's batch
    assert not any(backend.batch_exists(keys))
