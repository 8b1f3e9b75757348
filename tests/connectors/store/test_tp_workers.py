"""Heterogeneous TP through the store at the worker level: simulated TP=2 ranks (real caches,
real StoreWorkers, a real kvstore) save their shards, a TP=1 rank loads them, and the reverse.
Also: KV events count a block stored only once every rank's shards landed.

The engine-level P(TP=2) <-> D(TP=1) tests, real TP ranks included, are in test_store_tp_engines.py."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from pdcluster.connectors.store.backend_factory import make_backend
from pdcluster.connectors.store.events import StoredBlockTracker
from pdcluster.connectors.store.layout import StoreLayout
from pdcluster.connectors.store.meta import BlockSpec, StoreConnectorMetadata
from pdcluster.connectors.store.options import StoreOptions
from pdcluster.connectors.store.worker_side import StoreWorker
from pdcluster.engine.block_hash import compute_block_hashes
from pdcluster.engine.block_pool import BlockStored
from pdcluster.engine.kv_connector import KVCacheLayout

L, H, N, C, NB = 3, 4, 16, 32, 8


def store_layout(layout: str, ns: str) -> StoreLayout:
    return StoreLayout(model_id="tp-test", num_layers=L, total_num_kv_heads=H, head_dim=C, block_size=N,
                       kv_dtype="bfloat16", itemsize=2, store_tp_size=2, layout=layout, namespace=ns)


class Rank:
    def __init__(self, lay: StoreLayout, master: str, tp: int, rank: int, cache: torch.Tensor) -> None:
        self.cache = cache
        opts = StoreOptions(layout=lay, backend_options={"master": master}, save_staging_mib=1, load_staging_mib=1)
        self.worker = StoreWorker(opts)
        self.worker.register(cache, KVCacheLayout(num_layers=L, num_blocks=NB, block_size=N, num_kv_heads=H // tp,
                                                  head_dim=C, dtype="bfloat16", tp_rank=rank, tp_size=tp,
                                                  total_num_kv_heads=H))

    def save(self, rid: str, ids: list[int], hashes: list[bytes]) -> None:
        self.worker.start(StoreConnectorMetadata(saves=[BlockSpec(rid, ids, hashes)]))
        for layer in range(L):  # as the runner's per-layer hooks do
            self.worker.save_layer(layer, self.cache[layer])
        self.worker.wait_for_save()
        self.worker.start(StoreConnectorMetadata(finished=[rid]))
        self._wait(lambda: rid in self.worker.get_finished()[0], f"save {rid}")

    def load(self, rid: str, ids: list[int], hashes: list[bytes]) -> None:
        self.worker.start(StoreConnectorMetadata(loads=[BlockSpec(rid, ids, hashes)]))
        self._wait(lambda: rid in self.worker.get_finished()[1], f"load {rid}")
        assert self.worker.get_failed_blocks() == set()

    @staticmethod
    def _wait(pred, what: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not pred():
            assert time.monotonic() < deadline, f"{what} did not finish"
            time.sleep(0.01)


@pytest.fixture
def ranks(kvstore_master: str) -> Iterator[list[Rank]]:
    made: list[Rank] = []
    yield made
    for r in made:
        r.worker.shutdown()


def tp2_caches(full: torch.Tensor) -> list[torch.Tensor]:
    return [full[:, :, :, :, r * H // 2:(r + 1) * H // 2].contiguous() for r in range(2)]


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
def test_tp2_to_tp1_and_back(kvstore_master: str, ranks: list[Rank], layout: str) -> None:
    lay = store_layout(layout, f"tp-{layout}")
    full = torch.randn(L, 2, NB, N, H, C).to(torch.bfloat16)
    hashes = compute_block_hashes(list(range(3 * N)), N, parent=layout.encode() * 4)
    # P: TP=2, each rank saves its shard of blocks 1, 4, 6.
    p = [Rank(lay, kvstore_master, 2, r, c) for r, c in enumerate(tp2_caches(full))]
    ranks.extend(p)
    tracker = StoredBlockTracker(make_backend("kvstore", {"master": kvstore_master}), lay, poll_s=0.01)
    try:
        tracker.expect(hashes, None)
        p[0].save("p", [1, 4, 6], hashes)
        time.sleep(0.1)
        assert tracker.take() == [], "a block with one of two shards written must not count as stored"
        p[1].save("p", [1, 4, 6], hashes)
        Rank._wait(lambda: len(tracker._reported) == 3, "BlockStored after both ranks")
        events = tracker.take()
        assert [e.block_hashes for e in events if isinstance(e, BlockStored)] == [(h,) for h in hashes]
    finally:
        tracker.close()
    # D: TP=1 loads them into other blocks; every head exact.
    d = Rank(lay, kvstore_master, 1, 0, torch.zeros(L, 2, NB, N, H, C, dtype=torch.bfloat16))
    ranks.append(d)
    d.load("d", [0, 2, 3], hashes)
    assert torch.equal(d.cache[:, :, [0, 2, 3]], full[:, :, [1, 4, 6]])
    # Reverse: TP=1 saves new blocks, two TP=2 ranks load their halves.
    more = compute_block_hashes(list(range(2 * N)), N, parent=b"reverse" + layout.encode())
    d.cache[:, :, [5, 7]] = torch.randn(L, 2, 2, N, H, C).to(torch.bfloat16)
    d.save("d2", [5, 7], more)
    q = [Rank(lay, kvstore_master, 2, r, torch.zeros(L, 2, NB, N, H // 2, C, dtype=torch.bfloat16)) for r in range(2)]
    ranks.extend(q)
    for r, rank in enumerate(q):
        rank.load("q", [3, 0], more)
        assert torch.equal(rank.cache[:, :, [3, 0]], d.cache[:, :, [5, 7], :, r * 2:(r + 1) * 2])


def test_missing_shard_fails_the_block_not_silently(kvstore_master: str, ranks: list[Rank]) -> None:
    lay = store_layout("LBHNC", "tp-missing")
    full = torch.randn(L, 2, NB, N, H, C).to(torch.bfloat16)
    hashes = compute_block_hashes(list(range(2 * N)), N, parent=b"missing")
    r0 = Rank(lay, kvstore_master, 2, 0, tp2_caches(full)[0])
    d = Rank(lay, kvstore_master, 1, 0, torch.zeros(L, 2, NB, N, H, C, dtype=torch.bfloat16))
    ranks.extend([r0, d])
    r0.save("half", [2, 3], hashes)  # rank 1 never writes its shard
    d.worker.start(StoreConnectorMetadata(loads=[BlockSpec("d", [0, 1], hashes)]))
    Rank._wait(lambda: "d" in d.worker.get_finished()[1], "load")
    assert d.worker.get_failed_blocks() == {0, 1}
