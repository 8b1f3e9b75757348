"""Routing policies: pure, deterministic, no I/O."""

from __future__ import annotations

from collections import Counter

import pytest

from pdcluster.router.policies import (
    POLICIES,
    LeastLoaded,
    PowerOfTwo,
    PrefixAware,
    RoundRobin,
    RouteRequest,
    WorkerStats,
    WorkerView,
    make_policy,
)
from pdcluster.router.prefix_index import PrefixIndex

W = [WorkerView(f"w{i}", f"127.0.0.1:{9000 + i}") for i in range(4)]
REQ = RouteRequest("r1", prompt_token_ids=list(range(64)))


def hashes(n: int, salt: str = "") -> list[bytes]:
    return [f"{salt}b{i}".encode() for i in range(n)]


def test_round_robin_cycles_and_skips_unhealthy():
    p = RoundRobin()
    assert [p.pick(REQ, W, {}).worker_id for _ in range(5)] == ["w0", "w1", "w2", "w3", "w0"]
    sick = [W[0], WorkerView("w1", "x", healthy=False), W[2]]
    assert {p.pick(REQ, sick, {}).worker_id for _ in range(4)} == {"w0", "w2"}


def test_round_robin_turns_per_pool_so_interleaved_prefill_and_decode_picks_both_spread():
    p = RoundRobin()
    prefill = [WorkerView("p0", "x", role="prefill"), WorkerView("p1", "x", role="prefill")]
    decode = [WorkerView("d0", "x", role="decode"), WorkerView("d1", "x", role="decode")]
    picks = [(p.pick(REQ, prefill, {}).worker_id, p.pick(REQ, decode, {}).worker_id) for _ in range(4)]
    assert picks == [("p0", "d0"), ("p1", "d1"), ("p0", "d0"), ("p1", "d1")]


def test_no_healthy_worker_gives_none():
    sick = [WorkerView("w0", "x", healthy=False)]
    index = PrefixIndex()
    for p in (RoundRobin(), LeastLoaded(), PowerOfTwo(seed=1), PrefixAware(index)):
        assert p.pick(REQ, [], {}) is None
        assert p.pick(REQ, sick, {}) is None


def test_least_loaded_uses_max_of_inflight_and_reported_queue():
    stats = {
        "w0": WorkerStats(num_running=4, num_waiting=2),
        "w1": WorkerStats(num_inflight=5),  # stats stale, but the router knows 5 are in flight
        "w2": WorkerStats(num_running=3, num_inflight=1),
        "w3": WorkerStats(num_running=3, kv_usage=0.9),
    }
    assert LeastLoaded().pick(REQ, W, stats).worker_id == "w2"  # 3 queued, kv 0.0 beats w3's 0.9
    assert LeastLoaded().pick(REQ, W, {}).worker_id == "w0"  # all idle: list order
    assert LeastLoaded().pick(REQ, W[1:], {"w1": WorkerStats(num_waiting=1)}).worker_id == "w2"


def test_power_of_two_seeded_and_never_picks_the_busier_of_its_pair():
    stats = {w.worker_id: WorkerStats(num_running=i) for i, w in enumerate(W)}
    p1, p2 = PowerOfTwo(seed=7), PowerOfTwo(seed=7)
    assert [p1.pick(REQ, W, stats) for _ in range(50)] == [p2.pick(REQ, W, stats) for _ in range(50)]
    p = PowerOfTwo(seed=11)
    counts = Counter(p.pick(REQ, W, stats).worker_id for _ in range(600))
    # The busiest worker always loses its pair; less loaded workers win more pairs.
    assert "w3" not in counts and counts["w0"] > counts["w1"] > counts["w2"] > 0
    assert PowerOfTwo(seed=1).pick(REQ, W[:1], {}) == W[0]


def test_prefix_aware_prefers_cached_prefix():
    index = PrefixIndex()
    req = RouteRequest("r", block_hashes=hashes(8))
    index.add_blocks("w2", hashes(6))
    index.add_blocks("w1", hashes(2))
    assert PrefixAware(index).pick(req, W, {}).worker_id == "w2"


def test_prefix_aware_load_penalty_and_tie_break():
    index = PrefixIndex()
    req = RouteRequest("r", block_hashes=hashes(10))
    index.add_blocks("w0", hashes(3))  # 30% cached
    stats = {"w0": WorkerStats(num_running=10), "w1": WorkerStats(num_running=0)}
    # w0: 0.3 - 0.5 * 10/10 = -0.2 ; w1 (idle, uncached): 0.0 -> w1 wins
    assert PrefixAware(index).pick(req, W[:2], stats).worker_id == "w1"
    # Without a load penalty the cache wins.
    assert PrefixAware(index, load_weight=0.0).pick(req, W[:2], stats).worker_id == "w0"
    # Same overlap on two workers: the less loaded one.
    index.add_blocks("w1", hashes(3))
    stats = {"w0": WorkerStats(num_running=2), "w1": WorkerStats(num_running=1)}
    assert PrefixAware(index, load_weight=0.0).pick(req, W[:2], stats).worker_id == "w1"


def test_prefix_aware_falls_back_to_least_loaded():
    index = PrefixIndex()
    index.add_blocks("w0", hashes(4, salt="other"))
    stats = {"w0": WorkerStats(num_running=3), "w1": WorkerStats(num_running=1), "w2": WorkerStats(num_running=2)}
    req = RouteRequest("r", block_hashes=hashes(4))
    assert PrefixAware(index).pick(req, W[:3], stats).worker_id == "w1"
    assert PrefixAware(index).pick(RouteRequest("r"), W[:3], stats).worker_id == "w1"  # no hashes


def test_prefix_aware_ignores_unhealthy_cached_worker():
    index = PrefixIndex()
    index.add_blocks("w0", hashes(4))
    workers = [WorkerView("w0", "x", healthy=False), W[1]]
    assert PrefixAware(index).pick(RouteRequest("r", block_hashes=hashes(4)), workers, {}).worker_id == "w1"


def test_prefix_aware_computes_hashes_lazily():
    calls = []

    def fake_hash(token_ids, block_size, salt):
        calls.append((len(token_ids), block_size))
        return [bytes([t]) for t in token_ids[::block_size][: len(token_ids) // block_size]]

    index = PrefixIndex()
    index.add_blocks("w3", [bytes([0]), bytes([16])])
    p = PrefixAware(index, block_size=16, hash_fn=fake_hash)
    assert p.pick(REQ, W, {}).worker_id == "w3"
    assert calls == [(64, 16)]
    assert p.prefix_match(REQ, W) == {"w3": 2}
    # Precomputed hashes win; prompts shorter than a block need no hashing.
    p.pick(RouteRequest("r", prompt_token_ids=[1, 2, 3]), W, {})
    assert len(calls) == 2


def test_the_router_asks_every_policy_for_prefix_matches():
    # The router never checks a policy's class: non-prefix policies say "no hashes, no matches".
    for p in (RoundRobin(), LeastLoaded(), PowerOfTwo(seed=1)):
        assert p.block_hashes(REQ, 16) is None
        assert p.prefix_match(REQ, W) == {}
    index = PrefixIndex()
    index.add_blocks("w1", hashes(2))
    p = PrefixAware(index, hash_fn=lambda token_ids, block_size, salt: hashes(len(token_ids) // block_size))
    assert p.block_hashes(REQ) is None  # no block size yet: nothing to hash with
    assert p.block_hashes(REQ, 16) == hashes(4)  # the workers' block size, passed in, not assigned
    assert p.block_size is None
    assert p.block_hashes(RouteRequest("r", prompt_token_ids=[1, 2]), 16) == ()
    assert p.prefix_match(RouteRequest("r", block_hashes=hashes(4)), W) == {"w1": 2}


def test_prefix_aware_with_engine_block_hash():
    block_hash = pytest.importorskip("pdcluster.engine.block_hash")
    tokens = list(range(40))
    engine_hashes = block_hash.compute_block_hashes(tokens, 16)
    index = PrefixIndex()
    index.add_blocks("w1", engine_hashes[:2])
    p = PrefixAware(index, block_size=16)
    assert p.pick(RouteRequest("r", prompt_token_ids=tokens), W, {}).worker_id == "w1"


def test_registry():
    assert set(POLICIES) == {"round_robin", "least_loaded", "power_of_two", "prefix_aware"}
    assert isinstance(make_policy("power_of_two", seed=1), PowerOfTwo)
    assert isinstance(make_policy("prefix_aware", index=PrefixIndex()), PrefixAware)
    with pytest.raises(ValueError, match="unknown routing policy 'random'; available: least_loaded"):
        make_policy("random")
    with pytest.raises(ValueError, match="dotted paths are not accepted"):
        make_policy("pdcluster.router.policies:RoundRobin")
    with pytest.raises(TypeError):
        POLICIES["x"] = RoundRobin  # read-only registry
