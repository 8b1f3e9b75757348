"""`pdcluster serve --prefill 1 --decode 1`: router + a prefill worker + a decode worker as real
processes handing KV over through the P2P connector. Disaggregated output must equal offline
aggregated output token for token, over TCP and over shared memory, and every block must be free on
both workers afterwards."""

from __future__ import annotations

import json
import os
import time
import urllib.request

import grpc
import pytest
from serve_procs import descendants, start_serve, stop_serve

from pdcluster import LLM, SamplingParams
from pdcluster._proto import worker_pb2, worker_pb2_grpc
from pdcluster.client import Client

PROMPTS = [list(range(5, 5 + n)) for n in (3, 17, 40, 71)]


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory) -> str:
    from pdcluster.models.demo import ensure_demo_model

    return ensure_demo_model(tmp_path_factory.mktemp("demo") / "model")


def _start_cluster(model: str, transport: str | None, connector: str = "p2p"):
    opts = f" --kv-connector-options '{json.dumps({'transport': transport})}'" if transport else ""
    return start_serve(["--model", model, "--prefill", "1", "--decode", "1", "--policy", "round_robin",
                        "--connector", connector, "--kvstore-node-size", "64M",
                        "--worker-args", f"--max-model-len 256{opts}",
                        "--insecure-internal"])  # _blocks_used reads the workers' Stats in plaintext


def _blocks_used(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return worker_pb2_grpc.WorkerStub(ch).Stats(worker_pb2.StatsRequest(), timeout=10).num_kv_blocks_used


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_disaggregated_equals_aggregated(demo_model: str, transport: str) -> None:
    sp_greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    sp_seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True)
    offline = LLM(demo_model, max_model_len=256)
    want_greedy = [o.outputs[0].token_ids for o in offline.generate(PROMPTS, sp_greedy)]
    want_seeded = [o.outputs[0].token_ids for o in offline.generate(PROMPTS, sp_seeded)]
    # A stop string that starts in the prefill leg's token and ends in the decode leg's.
    t0_text = offline.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=1))[0].outputs[0].text
    full_text = offline.generate([PROMPTS[1]], sp_greedy)[0].outputs[0].text
    assert t0_text and len(full_text) > len(t0_text)
    sp_stop = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                             stop=[full_text[len(t0_text) - 1:len(t0_text) + 1]])
    want_stop = offline.generate([PROMPTS[1]], sp_stop)[0].outputs[0]
    assert want_stop.finish_reason == "stop" and len(want_stop.token_ids) >= 2
    proc, ready = _start_cluster(demo_model, transport)
    try:
        with Client(ready["grpc"], timeout=120) as client:
            got_greedy = [client.generate(p, sp_greedy).token_ids for p in PROMPTS]
            got_seeded = [client.generate(p, sp_seeded).token_ids for p in PROMPTS]
            streamed = [d.token_ids for d in client.generate_stream(PROMPTS[2], sp_greedy)]
            got_stop = client.generate(PROMPTS[1], sp_stop)
            stop_deltas = [d.text for d in client.generate_stream(PROMPTS[1], sp_stop)]
        assert got_greedy == want_greedy
        assert got_seeded == want_seeded
        assert [t for ids in streamed for t in ids] == want_greedy[2]  # first token streamed once
        assert (got_stop.text, got_stop.finish_reason, got_stop.stop_reason, got_stop.token_ids) == \
            (want_stop.text, "stop", want_stop.stop_reason, want_stop.token_ids)
        assert "".join(stop_deltas) == want_stop.text  # no part of the stop string was streamed
        metrics = urllib.request.urlopen(ready["http"] + "/metrics", timeout=10).read().decode()
        disagg = [ln for ln in metrics.splitlines()
                  if ln.startswith('pdcluster_router_disaggregated_requests_total{mode="disaggregated"}')]
        assert disagg and float(disagg[0].split()[-1]) == 2 * len(PROMPTS) + 3, metrics
        # The producer frees its blocks once the consumer says it is done reading; the consumer's
        # are ordinary finished-request blocks.
        for address in ready["workers"]:
            for _ in range(100):
                if _blocks_used(address) == 0:
                    break
                time.sleep(0.1)
            assert _blocks_used(address) == 0, address
    finally:
        stop_serve(proc)
    assert proc.returncode is not None


def test_disaggregated_through_the_store_equals_aggregated(demo_model: str) -> None:
    """`serve --connector store` starts a kvstore master and node beside the workers; the decode
    leg finds the prefill leg's blocks in it by their hashes."""
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(demo_model, max_model_len=256).generate(PROMPTS, sp)]
    proc, ready = _start_cluster(demo_model, None, connector="store")
    try:
        children = descendants(proc.pid)
        assert len(children) == 4, children  # prefill and decode workers, kvstore master and node
        with Client(ready["grpc"], timeout=120) as client:
            got = [client.generate(p, sp).token_ids for p in PROMPTS]
        assert got == want
        metrics = urllib.request.urlopen(ready["http"] + "/metrics", timeout=10).read().decode()
        moved = [ln for ln in metrics.splitlines() if ln.startswith("pdcluster_router_kv_transfer_tokens_total")]
        assert moved and float(moved[0].split()[-1]) > 0, "the decode legs were told of no KV to load"
        from pdcluster.kvstore import KVStoreClient

        with KVStoreClient(ready["kvstore_master"]) as kv:
            stats = kv.stats()
        assert stats["objects"] > 0 and stats["hit_rate"] > 0, stats  # the decode legs read from it
    finally:
        stop_serve(proc)
    assert proc.returncode == 0, f"serve exited with {proc.returncode}"
    assert not [pid for pid in children if os.path.exists(f"/proc/{pid}")], "a child outlived serve"
