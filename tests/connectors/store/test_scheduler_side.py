"""StoreScheduler bookkeeping against an in-memory backend (no processes, milliseconds)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from pdcluster.connectors.store.backend import PutResult, StoreBackend
from pdcluster.connectors.store.layout import StoreLayout
from pdcluster.connectors.store.meta import StoreConnectorMetadata
from pdcluster.connectors.store.options import StoreOptions
from pdcluster.connectors.store.scheduler_side import StoreScheduler
from pdcluster.connectors.store.staging import StagingRing
from pdcluster.engine.block_hash import compute_block_hashes
from pdcluster.engine.kv_connector import KVTransferParams
from pdcluster.engine.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from pdcluster.engine.request import Request
from pdcluster.sampling_params import SamplingParams

BS = 16
LAYOUT = StoreLayout(model_id="m", num_layers=2, total_num_kv_heads=2, head_dim=8, block_size=BS,
                     kv_dtype="float32", itemsize=4, store_tp_size=2)


class MemoryBackend(StoreBackend):
    name = "memory"

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.exists_calls = 0

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        self.exists_calls += 1
        return [k in self.objects for k in keys]

    def batch_put_from(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[PutResult]:
        return [PutResult.STORED for _ in keys]

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        return [k in self.objects for k in keys]

    def remove(self, keys: Sequence[str]) -> list[bool]:
        return [self.objects.pop(k, None) is not None for k in keys]

    def close(self) -> None:
        pass

    def store_blocks(self, hashes: Sequence[bytes], shards: Sequence[int] = (0, 1)) -> None:
        for h in hashes:
            for s in shards:
                self.objects[LAYOUT.key(s, h)] = b"x"


@pytest.fixture
def sched() -> Any:
    backend = MemoryBackend()
    # wait_for_producer_s: far longer than any test takes between asks, however slow the machine.
    s = StoreScheduler(StoreOptions(layout=LAYOUT, wait_for_producer_s=60.0, event_poll_s=0.01), BS, backend)
    s.backend = backend
    yield s
    s.shutdown()


def request(rid: str, n: int, kv: KVTransferParams | None = None, seed: int = 0, out: list[int] | None = None) -> Request:
    req = Request(rid, [(seed * 7919 + i) % 1000 + 3 for i in range(n)], SamplingParams(max_tokens=4),
                  kv_transfer_params=kv, output_token_ids=out)
    req.block_hashes = compute_block_hashes(req.all_token_ids, BS)
    return req


def step(s: StoreScheduler, new: list[tuple[Request, list[int], int, int]] = (),
         cached: list[tuple[Request, list[int], int, int]] = ()) -> StoreConnectorMetadata:
    so = SchedulerOutput(
        [NewRequestData(r.request_id, r.prompt_token_ids, [], r.sampling_params, b, c) for r, b, c, _ in new],
        [CachedRequestData(r.request_id, b, c) for r, b, c, _ in cached],
        {r.request_id: n for r, _, _, n in [*new, *cached]}, sum(n for *_, n in [*new, *cached]))
    return s.build_meta(so)


def test_longest_fully_present_prefix_one_rpc(sched: Any) -> None:
    req = request("r", 5 * BS + 3)
    sched.backend.store_blocks(req.block_hashes[:2])
    sched.backend.store_blocks(req.block_hashes[2:3], shards=(0,))  # block 2 lacks shard 1
    sched.backend.store_blocks(req.block_hashes[3:4])
    assert sched.get_num_new_matched_tokens(req, 0) == (2 * BS, True)
    assert sched.backend.exists_calls == 1
    # Local hits extend the run: blocks 0..2 local, 3 in the store -> 4 blocks.
    assert sched.get_num_new_matched_tokens(req, 3 * BS) == (BS, True)
    assert sched.backend.exists_calls == 1  # the lookup is reused while the request waits


def test_never_claims_the_last_token(sched: Any) -> None:
    req = request("r", 3 * BS)
    sched.backend.store_blocks(req.block_hashes)
    assert sched.get_num_new_matched_tokens(req, 0) == (3 * BS - 1, True)
    sched.update_state_after_alloc(req, [7, 8, 9], 3 * BS - 1)
    meta = step(sched)
    assert [(s.block_ids, s.block_hashes) for s in meta.loads] == [([7, 8, 9], req.block_hashes)]


def test_saves_skip_present_and_loaded_blocks(sched: Any) -> None:
    req = request("r", 4 * BS + 5)
    sched.backend.store_blocks(req.block_hashes[:2])
    n, is_async = sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, [10, 11, 12, 13, 14], n)
    assert [s.block_ids for s in step(sched).loads] == [[10, 11]]
    # Load done; admitted with its loaded blocks (no new lookup), then the rest computed in 2 chunks.
    sched.update_state_after_alloc(req, [10, 11, 12, 13, 14], 0)
    m1 = step(sched, new=[(req, [10, 11, 12, 13, 14], 2 * BS, BS + 3)])
    assert [(s.block_ids, s.block_hashes) for s in m1.saves] == [([12], req.block_hashes[2:3])]
    m2 = step(sched, cached=[(req, [], 3 * BS + 3, BS + 2)])
    assert [s.block_ids for s in m2.saves] == [[13]]
    # Another request with the same prefix does not save blocks this instance just saved.
    other = request("o", 4 * BS + 5)
    sched.get_num_new_matched_tokens(other, 0)
    sched.update_state_after_alloc(other, [20, 21, 22, 23, 24], 0)
    assert step(sched, new=[(other, [20, 21, 22, 23, 24], 2 * BS, 2 * BS + 5)]).saves == []
    # Saves in flight: the finished request keeps its blocks until the ranks report them written.
    assert sched.request_finished(req, [10, 11, 12, 13, 14]) == (True, None)
    assert step(sched).finished == ["r"]
    assert sched.request_finished(other, [20]) == (False, None)


def test_finish_while_loading_cancels(sched: Any) -> None:
    req = request("r", 3 * BS + 1)
    sched.backend.store_blocks(req.block_hashes)
    n, _ = sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, [1, 2, 3, 4], n)
    step(sched)
    assert sched.request_finished(req, [1, 2, 3, 4]) == (False, None)
    assert step(sched).cancels == ["r"]


def test_producer_params_and_consumer_waits_for_them(sched: Any) -> None:
    prod = request("p", 2 * BS + 4, kv=KVTransferParams(do_remote_decode=True))
    sched.get_num_new_matched_tokens(prod, 0)
    sched.update_state_after_alloc(prod, [1, 2, 3], 0)
    step(sched, new=[(prod, [1, 2, 3], 0, 2 * BS + 4)])
    delay, params = sched.request_finished(prod, [1, 2, 3])
    assert delay and params.connector == "store" and params.num_tokens == 2 * BS
    # The decode leg (prompt + the first token) arrives before the saves landed: ask again later.
    cons = request("p", 2 * BS + 4, kv=params.for_decode_leg(), out=[5])
    assert sched.get_num_new_matched_tokens(cons, 0) == (None, False)
    sched.backend.store_blocks(prod.block_hashes[:2])
    import time

    time.sleep(0.02)
    assert sched.get_num_new_matched_tokens(cons, 0) == (2 * BS, True)
    # Another prompt with these params does not wait for blocks that are not its own.
    other = request("x", 2 * BS + 4, kv=params.for_decode_leg(), seed=5)
    assert sched.get_num_new_matched_tokens(other, 0) == (0, False)


def test_store_down_computes_locally(sched: Any) -> None:
    def boom(keys: Sequence[str]) -> list[bool]:
        from pdcluster.connectors.store.backend import StoreBackendError

        raise StoreBackendError("down")

    sched.backend.batch_exists = boom
    req = request("r", 3 * BS)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert sched.get_num_new_matched_tokens(request("s", 40), 0) == (0, False)
    assert sched.counters["lookup_errors"] == 1  # backed off: no second RPC per request


def test_metadata_round_trips_as_plain_data() -> None:
    import msgpack

    from pdcluster.connectors.store.meta import BlockSpec

    meta = StoreConnectorMetadata([BlockSpec("a", [1, 2], [b"\x01" * 32, b"\x02" * 32])], [BlockSpec("b", [3], [b"\x03" * 32])],
                                  ["c"], ["d"])
    wire = msgpack.packb(meta.to_dict(), use_bin_type=True)
    assert StoreConnectorMetadata.from_dict(msgpack.unpackb(wire, raw=False)) == meta
    with pytest.raises(ValueError):
        StoreConnectorMetadata.from_dict({"loads": [["a", [1], ["not bytes"]]]})


def test_staging_ring_fifo_and_wrap() -> None:
    ring = StagingRing(8, 10)
    a = ring.alloc(4)
    b = ring.alloc(4)
    assert (a, b) == (0, 4)
    assert ring.alloc(4) is None  # only 2 left at the end, nothing free at the start
    ring.free(a)
    c = ring.alloc(3)  # wraps into the space a left
    assert c == 0
    ring.free(c)  # freed out of order: reclaimed after b
    assert ring.alloc(5) is None
    ring.free(b)
    assert ring.num_live_runs == 0 and ring.alloc(10) == 0
    assert ring.slots(0, 10).shape == (10, 8)


def test_events_stored_when_every_shard_lands_removed_when_gone(sched: Any) -> None:
    import time

    from pdcluster.engine.block_pool import BlockRemoved, BlockStored

    req = request("r", 2 * BS + 1)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, [1, 2, 3], 0)
    step(sched, new=[(req, [1, 2, 3], 0, 2 * BS + 1)])  # both blocks' saves scheduled
    sched.backend.store_blocks(req.block_hashes, shards=(0,))  # one shard of each: not stored yet
    time.sleep(0.1)
    assert sched.take_events() == []
    sched.backend.store_blocks(req.block_hashes, shards=(1,))
    deadline = time.monotonic() + 5
    events: list[Any] = []
    while len(events) < 2 and time.monotonic() < deadline:
        events += sched.take_events()
        time.sleep(0.01)
    assert events == [BlockStored((req.block_hashes[0],), parent_hash=None),
                      BlockStored((req.block_hashes[1],), parent_hash=req.block_hashes[0])]
    for k in LAYOUT.block_keys(req.block_hashes[1]):  # evicted
        del sched.backend.objects[k]
    sched.get_num_new_matched_tokens(request("again", 2 * BS + 1), 0)
    assert sched.take_events() == [BlockRemoved((req.block_hashes[1],))]
