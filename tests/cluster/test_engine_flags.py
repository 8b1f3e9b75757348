"""vLLM's engine flags on serve-worker, `serve` and `up` (issue 18, item 4): parsed by vLLM's
names, forwarded to every pool or to one (--prefill-FLAG, --decode-FLAG), merged over a YAML pool's
`engine` section; and a real `pdcluster serve` whose workers report what the flags asked."""

from __future__ import annotations

import json
import urllib.request

import grpc
from serve_procs import start_serve, stop_serve

from pdcluster._proto import common_pb2, worker_pb2, worker_pb2_grpc
from pdcluster.cluster.cli import build_parser
from pdcluster.cluster.up_cmd import apply_engine_overrides, build_config
from pdcluster.cluster.worker_cmd import worker_config
from pdcluster.cluster.worker_flags import engine_argv, forwarded_engine


def test_serve_worker_takes_vllm_names():
    p = build_parser()
    args = p.parse_args(["serve-worker", "--max-model-len", "512", "--max-num-seqs", "8", "--max-num-batched-tokens",
                         "256", "--block-size", "32", "--dtype", "float32", "--kv-cache-dtype", "fp8", "--seed", "3",
                         "--kv-cache-memory-bytes", "1000000", "--no-enable-prefix-caching", "--enforce-eager",
                         "--scheduling-policy", "priority"])
    engine = worker_config(args).engine
    assert {k: engine[k] for k in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size", "dtype",
                                   "kv_cache_dtype", "seed", "kv_cache_memory_bytes", "enable_prefix_caching")} == {
        "max_model_len": 512, "max_num_seqs": 8, "max_num_batched_tokens": 256, "block_size": 32, "dtype": "float32",
        "kv_cache_dtype": "fp8", "seed": 3, "kv_cache_memory_bytes": 1000000, "enable_prefix_caching": False}
    assert engine["scheduling_policy"] == "priority"
    held = worker_config(p.parse_args(["serve-worker", "--kv-load-wait-ms", "15"])).engine
    assert held["kv_load_wait_ms"] == 15.0
    capped = worker_config(p.parse_args(["serve-worker", "--long-prefill-token-threshold", "32"])).engine
    assert capped["long_prefill_token_threshold"] == 32
    spec = worker_config(p.parse_args(["serve-worker", "--speculative-config", '{"method": "ngram"}'])).engine
    assert spec["speculative_config"] == '{"method": "ngram"}'  # parsed (and refused by name) by the engine
    assert worker_config(p.parse_args(["serve-worker", "--enable-prefix-caching"])).engine["enable_prefix_caching"]
    defaults = worker_config(p.parse_args(["serve-worker"])).engine  # as before the vLLM names
    assert defaults["enable_prefix_caching"] and p.parse_args(["serve-worker"]).enforce_eager is False
    assert {k: defaults[k] for k in ("dtype", "kv_cache_dtype", "block_size", "max_num_seqs", "seed", "max_model_len",
                                     "kv_load_wait_ms", "long_prefill_token_threshold")} \
        == {"dtype": "auto", "kv_cache_dtype": "auto", "block_size": 16, "max_num_seqs": 64, "seed": 0,
            "max_model_len": None, "kv_load_wait_ms": 0.0, "long_prefill_token_threshold": 0}
    assert not worker_config(p.parse_args(["serve-worker", "--no-prefix-caching"])).engine["enable_prefix_caching"]


def test_serve_forwards_engine_flags_per_pool():
    args = build_parser().parse_args(["serve", "--prefill", "1", "--decode", "1", "--max-model-len", "512",
                                      "--no-enable-prefix-caching", "--decode-max-num-seqs", "8",
                                      "--prefill-enable-prefix-caching", "--seed", "5", "--decode-kv-load-wait-ms", "20",
                                      "--decode-long-prefill-token-threshold", "32"])
    assert engine_argv(forwarded_engine(args, "prefill")) == ["--max-model-len", "512", "--seed", "5"]
    assert engine_argv(forwarded_engine(args, "decode")) == ["--max-model-len", "512", "--seed", "5",
                                                             "--no-prefix-caching", "--max-num-seqs", "8",
                                                             "--kv-load-wait-ms", "20.0",
                                                             "--long-prefill-token-threshold", "32"]
    assert engine_argv(forwarded_engine(args, "both")) == ["--max-model-len", "512", "--seed", "5",
                                                           "--no-prefix-caching"]


def test_up_merges_engine_flags_over_the_yaml_pools():
    args = build_parser().parse_args(["up", "--max-num-seqs", "32", "--decode-max-num-seqs", "128",
                                      "--served-model-name", "svc", "--kv-cache-dtype", "fp8"])
    raw = {"pools": {"prefill": {"engine": {"max_model_len": 512}}, "decode": {"instances": 2}},
           "connector": {"name": "p2p"}}
    # A YAML mapping reaches serve-worker as its JSON text.
    assert engine_argv({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}) == [
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']
    merged = apply_engine_overrides(raw, args)
    assert merged["pools"]["prefill"]["engine"] == {"max_model_len": 512, "max_num_seqs": 32, "kv_cache_dtype": "fp8"}
    assert merged["pools"]["decode"]["engine"] == {"max_num_seqs": 128, "kv_cache_dtype": "fp8"}
    config = build_config(build_parser().parse_args(["up", "--prefill", "1", "--decode", "1", "--connector", "p2p",
                                                     "--decode-block-size", "32", "--served-model-name", "svc"]))
    assert config.pools["decode"].engine == {"block_size": 32} and config.pools["prefill"].engine == {}
    assert config.router.served_model_name == ("svc",)


def _info(address: str) -> worker_pb2.WorkerInfo:
    with grpc.insecure_channel(address) as ch:
        return worker_pb2_grpc.WorkerStub(ch).GetInfo(worker_pb2.GetInfoRequest(), timeout=10)


def test_serve_workers_get_the_flags(tmp_path):
    from pdcluster.models.demo import ensure_demo_model

    model = str(ensure_demo_model(tmp_path / "model"))
    proc, ready = start_serve(["--model", model, "--prefill", "1", "--decode", "1", "--max-model-len", "200",
                               "--block-size", "32", "--prefill-num-kv-blocks", "40", "--decode-num-kv-blocks", "50",
                               "--served-model-name", "svc", "--scheduling-policy", "priority",
                               "--decode-speculative-config", '{"method": "ngram", "prompt_lookup_min": 1, "adaptive": false}',
                               "--insecure-internal"])  # _info reads the workers' GetInfo in plaintext
    try:
        got = sorted((i.role, i.max_model_len, i.block_size, i.num_kv_blocks_total)
                     for i in (_info(a) for a in ready["workers"]))
        assert got == [(common_pb2.WORKER_ROLE_PREFILL, 200, 32, 40), (common_pb2.WORKER_ROLE_DECODE, 200, 32, 50)]
        models = json.loads(urllib.request.urlopen(ready["http"] + "/v1/models", timeout=10).read())
        assert models["data"][0]["id"] == "svc" and models["data"][0]["max_model_len"] == 200
        # --scheduling-policy priority reached both legs: a request's priority is taken by each.
        body = json.dumps({"model": "svc", "prompt": "Hello", "max_tokens": 3, "priority": -4}).encode()
        req = urllib.request.Request(ready["http"] + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        answer = json.loads(urllib.request.urlopen(req, timeout=60).read())
        assert answer["usage"]["completion_tokens"] >= 1
        # --decode-speculative-config reached the decode worker only: it checks drafts.
        body = json.dumps({"model": "svc", "prompt": "a b c d a b c d a b c d a b c", "max_tokens": 16,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(ready["http"] + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        assert json.loads(urllib.request.urlopen(req, timeout=60).read())["usage"]["completion_tokens"] == 16
        drafts = {}
        for inst in ready["instances"].values():
            text = urllib.request.urlopen(inst["metrics"], timeout=10).read().decode()
            drafts[inst["role"]] = [line for line in text.splitlines()
                                    if line.startswith("pdcluster_engine_spec_decode_draft_tokens_total")]
        assert drafts["prefill"] == [] and float(drafts["decode"][0].split()[-1]) > 0
    finally:
        stop_serve(proc)
