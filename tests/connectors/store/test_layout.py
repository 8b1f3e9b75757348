"""StoreLayout: shards, keys and exact head round trips between every TP size and layout."""

from __future__ import annotations

import itertools

import pytest
import torch

from pdcluster.connectors.store.block_io import pack_all, pack_layer, shard_objects, unpack_blocks
from pdcluster.connectors.store.layout import StoreLayout, default_store_tp_size
from pdcluster.engine.block_hash import compute_block_hashes

L, H, N, C = 2, 4, 4, 8  # layers, global KV heads, block size, head dim
NUM_BLOCKS = 6


def make_layout(store_tp: int, layout: str = "LBHNC", **kw) -> StoreLayout:
    args = dict(model_id="m", num_layers=L, total_num_kv_heads=H, head_dim=C, block_size=N, kv_dtype="float32",
                itemsize=4, store_tp_size=store_tp, layout=layout)
    args.update(kw)
    return StoreLayout(**args)


def valid(store_tp: int, tp: int) -> bool:
    try:
        make_layout(store_tp).check_tp(tp)
    except ValueError:
        return False
    return True


def test_default_store_tp_size() -> None:
    assert default_store_tp_size([1], 8) == 1
    assert default_store_tp_size([1, 2], 8) == 2
    assert default_store_tp_size([2, 4], 8) == 4
    assert default_store_tp_size([2, 3], 6) == 6
    assert default_store_tp_size([1, 16], 8) == 8  # replicated heads: bounded by H
    assert default_store_tp_size([4, 8], 2) == 2
    with pytest.raises(ValueError):
        default_store_tp_size([], 8)


def test_key_format_and_tp_instances_share_keys() -> None:
    h = bytes(range(32))
    tp1 = make_layout(default_store_tp_size([1, 2], H))
    tp2 = make_layout(default_store_tp_size([2, 1], H))
    assert tp1.key(1, h) == tp2.key(1, h)
    assert tp1.key(0, h) == f"pdcluster@{tp1.fingerprint}@pp0@shard0/2@{h.hex()}"
    assert len(tp1.fingerprint) == 16
    # Whatever a TP=2 rank writes, a TP=1 rank reads under the same names.
    written = {tp2.key(s.shard, h) for r in range(2) for s in tp2.rank_shards(r, 2) if s.writes}
    assert written == {tp1.key(s.shard, h) for s in tp1.rank_shards(0, 1)}


@pytest.mark.parametrize("change", [dict(model_id="other"), dict(kv_dtype="bfloat16", itemsize=2), dict(layout="LBNHC"),
                                    dict(block_size=8), dict(store_tp_size=4), dict(compute_dtype="float32"),
                                    dict(num_layers=3)])
def test_fingerprint_covers_schema(change: dict) -> None:
    store_tp = change.pop("store_tp_size", 2)
    assert make_layout(2).fingerprint != make_layout(store_tp, **change).fingerprint
    assert make_layout(2).fingerprint == make_layout(2).fingerprint  # and is stable


def test_refused_combinations() -> None:
    assert [(s, t) for s in (1, 2, 4) for t in (1, 2, 4, 8) if not valid(s, t)] == [(1, 2), (1, 4), (1, 8), (2, 4), (2, 8)]


def test_rejects_bad_layouts() -> None:
    with pytest.raises(ValueError, match="divide"):
        make_layout(3)
    with pytest.raises(ValueError, match="namespace"):
        make_layout(2, namespace="a@b")
    with pytest.raises(ValueError, match="multiple"):
        make_layout(1).rank_shards(0, 2)  # a TP=2 rank would hold half a shard
    with pytest.raises(ValueError, match="one head per shard"):
        make_layout(2).rank_shards(0, 8)


@pytest.mark.parametrize("store_tp,tp", [(s, t) for s in (1, 2, 4) for t in (1, 2, 4, 8) if valid(s, t)])
def test_every_shard_written_exactly_once(store_tp: int, tp: int) -> None:
    lay = make_layout(store_tp)
    writers = [s.shard for r in range(tp) for s in lay.rank_shards(r, tp) if s.writes]
    assert sorted(writers) == list(range(store_tp))


def rank_heads(tp: int, rank: int) -> tuple[int, int]:
    if tp <= H:
        return rank * H // tp, (rank + 1) * H // tp
    head = rank * H // tp
    return head, head + 1


def write_instance(lay: StoreLayout, full: torch.Tensor, tp: int, block_ids: list[int], hashes: list[bytes],
                   per_layer: bool) -> dict[str, bytes]:
    """Every rank of a TP-`tp` instance packs the shards it writes; returns the 'store'."""
    store: dict[str, bytes] = {}
    for rank in range(tp):
        h0, h1 = rank_heads(tp, rank)
        cache = full[:, :, :, :, h0:h1].clone()  # this rank's (L, 2, nb, N, h, C)
        for s in lay.rank_shards(rank, tp):
            if not s.writes:
                continue
            slots = torch.zeros(len(block_ids), lay.object_nbytes, dtype=torch.uint8)
            objs = shard_objects(slots, lay, cache.dtype)
            if per_layer:
                for layer in range(L):
                    pack_layer(cache[layer], layer, block_ids, objs, lay, s.local_h0, s.local_h1)
            else:
                pack_all(cache, block_ids, objs, lay, s.local_h0, s.local_h1)
            for i, h in enumerate(hashes):
                assert lay.key(s.shard, h) not in store, "two ranks wrote one shard"
                store[lay.key(s.shard, h)] = slots[i].numpy().tobytes()
    return store


def read_instance(lay: StoreLayout, store: dict[str, bytes], tp: int, block_ids: list[int],
                  hashes: list[bytes]) -> list[torch.Tensor]:
    caches = []
    for rank in range(tp):
        h0, h1 = rank_heads(tp, rank)
        cache = torch.full((L, 2, NUM_BLOCKS, N, h1 - h0, C), float("nan"))
        for s in lay.rank_shards(rank, tp):
            raw = b"".join(store[lay.key(s.shard, h)] for h in hashes)
            slots = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(len(hashes), lay.object_nbytes)
            unpack_blocks(shard_objects(slots, lay, cache.dtype), cache, block_ids, lay, s.local_h0, s.local_h1)
        caches.append(cache)
    return caches


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
@pytest.mark.parametrize("store_tp", [1, 2, 4])
def test_round_trip_between_all_tp_sizes(layout: str, store_tp: int) -> None:
    """Any writer TP -> any reader TP through the store: every head of every block exact."""
    lay = make_layout(store_tp, layout)
    full = torch.randn(L, 2, NUM_BLOCKS, N, H, C)
    hashes = compute_block_hashes(list(range(3 * N)), N)
    src_ids, dst_ids = [4, 1, 3], [0, 5, 2]
    tps = [t for t in (1, 2, 4, 8) if valid(store_tp, t)]
    for (writer, reader), per_layer in itertools.product(itertools.product(tps, tps), (True, False)):
        store = write_instance(lay, full, writer, src_ids, hashes, per_layer)
        assert len(store) == 3 * store_tp
        for rank, cache in enumerate(read_instance(lay, store, reader, dst_ids, hashes)):
            h0, h1 = rank_heads(reader, rank)
            for dst, src in zip(dst_ids, src_ids):
                assert torch.equal(cache[:, :, dst], full[:, :, src, :, h0:h1]), (writer, reader, rank)
            untouched = [b for b in range(NUM_BLOCKS) if b not in dst_ids]
            assert torch.isnan(cache[:, :, untouched]).all()


def test_tp2_ranks_to_tp1_cache_bf16() -> None:
    """Two simulated TP=2 rank caches (real bf16 tensors) -> one TP=1 cache, and back."""
    lay = make_layout(2, "LBHNC", kv_dtype="bfloat16", itemsize=2)
    full = torch.randn(L, 2, NUM_BLOCKS, N, H, C).to(torch.bfloat16)
    hashes = compute_block_hashes(list(range(100, 100 + 2 * N)), N)
    store = write_instance(lay, full, 2, [2, 5], hashes, per_layer=True)
    cache = torch.zeros(L, 2, NUM_BLOCKS, N, H, C, dtype=torch.bfloat16)
    for s in lay.rank_shards(0, 1):
        raw = b"".join(store[lay.key(s.shard, h)] for h in hashes)
        slots = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(2, lay.object_nbytes)
        unpack_blocks(shard_objects(slots, lay, torch.bfloat16), cache, [0, 1], lay, s.local_h0, s.local_h1)
    assert torch.equal(cache[:, :, [0, 1]], full[:, :, [2, 5]])
    back = write_instance(lay, cache, 1, [0, 1], hashes, per_layer=False)
    assert back == store  # TP=1 writes byte-identical objects under the same keys
