"""Routing decisions with fake workers: prefix-aware placement fed by real (CURVE) KV events, and
the disaggregated prefill -> decode flow."""

from __future__ import annotations

import time

from pdcluster._proto import common_pb2, router_pb2

SP = common_pb2.SamplingParams


def gen(stub, ids, max_tokens=2, **kw):
    req = router_pb2.GenerateRequest(prompt_token_ids=router_pb2.TokenIds(ids=ids), stream=True,
                                     sampling_params=SP(max_tokens=max_tokens), **kw)
    return list(stub.Generate(req, timeout=10))


def wait_until(cond, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_prefix_aware_follows_the_cache(fake_cluster, key_dir):
    opts = [{"key_dir": str(key_dir), "block_size": 4}, {"key_dir": str(key_dir), "block_size": 4}]
    c = fake_cluster(2, worker_opts=opts, policy="prefix_aware", key_dir=str(key_dir))
    shared = list(range(100, 164))  # 16 blocks of 4
    first = gen(c.stub, shared + [1, 2])[-1].route.decode_worker_id
    holder = 0 if first == "w0" else 1
    # The worker published the prompt's blocks; wait until the router's index has them.
    index = c.router.index
    assert wait_until(lambda: c.lt.call(lambda: index.num_blocks(first)) >= 16)
    for tail in ([3], [4, 5], [6, 7, 8, 9]):
        assert gen(c.stub, shared + tail)[-1].route.decode_worker_id == first
    other = f"w{1 - holder}"
    # A prompt nobody cached goes by load: both idle -> either; with the holder busy -> the other.
    c.workers[holder].opts.token_delay_s = 0.05
    busy = c.stub.Generate(router_pb2.GenerateRequest(prompt_token_ids=router_pb2.TokenIds(ids=shared + [11]),
                                                      sampling_params=SP(max_tokens=1000), stream=True), timeout=10)
    next(busy)
    assert gen(c.stub, list(range(500, 540)))[-1].route.decode_worker_id == other
    busy.cancel()
    text = c.lt.call(lambda: c.router.metrics.render().decode())
    assert "pdcluster_router_prefix_index_blocks" in text


def test_prefix_aware_refuses_unknown_publisher_keys(fake_cluster, key_dir, tmp_path):
    from pdcluster.security.keys import init_keys

    rogue = init_keys(tmp_path / "rogue", ("router", "worker")).root  # a key the cluster did not issue
    c = fake_cluster(1, worker_opts=[{"key_dir": str(rogue)}], policy="prefix_aware", key_dir=str(key_dir))
    gen(c.stub, list(range(64)))
    assert wait_until(lambda: c.lt.call(lambda: c.router.kv_sync.refusals["unknown_publisher_key"]) >= 1)
    text = c.lt.call(lambda: c.router.metrics.render().decode())
    assert 'pdcluster_router_kv_event_refusals_total{reason="unknown_publisher_key"} 1.0' in text


def test_disaggregated_flow(fake_cluster):
    c = fake_cluster(2, worker_opts=[{"role": "prefill", "worker_id": "p0"}, {"role": "decode", "worker_id": "d0"}])
    out = gen(c.stub, list(range(40)), max_tokens=4)
    last = out[-1]
    assert last.route.disaggregated and last.route.prefill_worker_id == "p0" and last.route.decode_worker_id == "d0"
    assert [t for r in out for t in r.token_ids] == [40, 41, 42, 43]
    pre, dec = c.workers[0].requests[-1], c.workers[1].requests[-1]
    assert pre.sampling_params.max_tokens == 1 and pre.kv_transfer_params.do_remote_decode and not pre.stream
    assert dec.sampling_params.max_tokens == 4 and dec.kv_transfer_params.do_remote_prefill
    assert dec.kv_transfer_params.producer_id == "p0" and list(dec.kv_transfer_params.block_ids) == [0, 1, 2]
    assert pre.request_id == dec.request_id == last.request_id
    # Without a prefill worker the decode pool serves alone (prefilling locally).
    c.stop_worker(0)
    assert wait_until(lambda: c.healthy_ids() == {"d0"})
    last = gen(c.stub, list(range(40)))[-1]
    assert not last.route.disaggregated and last.route.decode_worker_id == "d0"
    assert not c.workers[1].requests[-1].HasField("kv_transfer_params")


def test_disaggregated_cancel_aborts_both_legs(fake_cluster):
    c = fake_cluster(2, worker_opts=[{"role": "prefill", "worker_id": "p0"},
                                     {"role": "decode", "worker_id": "d0", "token_delay_s": 0.02}])
    stream = c.stub.Generate(router_pb2.GenerateRequest(
        request_id="pd-1", prompt_token_ids=router_pb2.TokenIds(ids=list(range(40))), stream=True,
        sampling_params=SP(max_tokens=500)), timeout=10)
    next(stream)
    stream.cancel()
    # The decode leg is cancelled; the prefill worker (finished, maybe holding a lease) gets an Abort.
    assert wait_until(lambda: "pd-1" in c.workers[1].aborted and not c.workers[1].running)
    assert gen(c.stub, [1, 2, 3])[-1].finished
