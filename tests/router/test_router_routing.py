"""Routing decisions in front of real `serve-worker` processes: prefix-aware placement fed by the
workers' real KV events over CURVE, and refusing a publisher key the router's keys do not list.
(The disaggregated prefill -> decode flow needs a KV connector; its tests live with it.)"""

from __future__ import annotations

import random

from real_router_cluster import wait_until, worker_stats

from pdcluster._proto import common_pb2, router_pb2

SamplingParams = common_pb2.SamplingParams


def request(ids, max_tokens=2) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(prompt_token_ids=router_pb2.TokenIds(ids=ids), stream=True,
                                      sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))


def gen(stub, ids, max_tokens=2) -> router_pb2.GenerateResponse:
    """The final response (route, usage)."""
    return list(stub.Generate(request(ids, max_tokens), timeout=30))[-1]


def test_prefix_aware_follows_the_cache(cluster, key_dir):
    c = cluster(2, policy="prefix_aware", key_dir=str(key_dir))
    rng = random.Random(20240611)  # prompts no other test sends: the workers' caches outlive tests
    shared = [rng.randrange(10, 600) for _ in range(160)]  # 10 blocks of 16
    first = gen(c.stub, shared + [5]).route.decode_worker_id
    holder = next(w for w in c.workers if w.worker_id == first)
    other = next(w for w in c.workers if w is not holder)
    # The worker published the prompt's blocks; wait until the router's index has them.
    assert wait_until(lambda: c.lt.call(lambda: c.router.index.num_blocks(first)) >= 10)
    for tail in ([6], [7, 8], [9, 10, 11]):
        last = gen(c.stub, shared + tail)
        assert last.route.decode_worker_id == first
        assert last.usage.cached_tokens >= 160  # the worker really reused the blocks
    # A prompt nobody cached goes by load: with the holder busy, to the other worker.
    busy_request = request(shared + [12], max_tokens=90)
    busy_request.request_id = "held-busy"  # held on the worker (real_router_cluster.HELD_CLI) until cancelled
    busy = c.stub.Generate(busy_request, timeout=30)
    next(busy)
    assert worker_stats(holder.address).num_running == 1
    fresh = [rng.randrange(10, 600) for _ in range(40)]
    assert gen(c.stub, fresh).route.decode_worker_id == other.worker_id
    busy.cancel()
    assert "pdcluster_router_prefix_index_blocks" in c.metrics_text()


def test_prefix_aware_refuses_unknown_publisher_keys(cluster, tmp_path):
    """The workers publish with the cluster's worker key; this router's key folder is another
    cluster's, so that key is one it did not issue: it must not subscribe (and still routes)."""
    from pdcluster.security.keys import init_keys

    rogue = init_keys(tmp_path / "rogue", ("router", "worker")).root
    c = cluster(1, policy="prefix_aware", key_dir=str(rogue))
    assert gen(c.stub, list(range(64))).finished
    assert wait_until(lambda: c.lt.call(lambda: c.router.kv_sync.refusals["unknown_publisher_key"]) >= 1)
    text = c.metrics_text()
    assert 'pdcluster_router_kv_event_refusals_total{reason="unknown_publisher_key"} 1.0' in text
    assert c.lt.call(lambda: c.router.index.num_blocks(c.workers[0].worker_id)) == 0


def test_prefix_aware_follows_a_salted_cache(cluster, key_dir):
    """Workers key a salted prompt's blocks by its cache_salt; the router hashes it the same way,
    so the salted prompt follows its cache, and the same tokens under another salt do not."""
    c = cluster(2, policy="prefix_aware", key_dir=str(key_dir))
    rng = random.Random(20261206)
    shared = [rng.randrange(10, 600) for _ in range(160)]  # 10 blocks of 16

    def salted(ids, salt):
        req = request(ids)
        req.sampling_params.cache_salt = salt
        return list(c.stub.Generate(req, timeout=30))[-1]

    first = salted(shared + [5], "tenant-a").route.decode_worker_id
    # The blocks the worker published are the ones the router computes for the salted prompt
    # (the worker may hold other tests' blocks: wait for these ones).
    from pdcluster.router.policies import RouteRequest

    def indexed(salt):
        hashes = c.router.policy.block_hashes(RouteRequest("q", shared, cache_salt=salt), 16)
        return c.lt.call(lambda: c.router.index.match(hashes)).get(first, 0)

    assert wait_until(lambda: indexed("tenant-a") == 10)
    assert indexed("tenant-b") == 0 and indexed(None) == 0
    for tail in ([6], [7, 8]):
        last = salted(shared + tail, "tenant-a")
        assert last.route.decode_worker_id == first
        assert last.usage.cached_tokens >= 160
    other_salt = salted(shared + [9], "tenant-b")
    assert other_salt.usage.cached_tokens == 0  # wherever it went, nothing cached was shared
    assert gen(c.stub, shared + [10]).usage.cached_tokens == 0  # nor without a salt
