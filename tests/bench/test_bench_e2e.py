"""`bench serve` and `bench sweep` against real local clusters of the demo model: aggregated
(`pdcluster serve --workers 1`) and disaggregated (`--prefill 1 --decode 1`, P2P), through the gRPC
`pdcluster` backend and the OpenAI HTTP backend. Every cluster is a `pdcluster serve` child on free
loopback ports, stopped by pid when its fixture ends."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest

from pdcluster.cluster.cli import main

NUM_PROMPTS = 4
OUTPUT_LEN = 8


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from pdcluster.models.demo import ensure_demo_model

    return ensure_demo_model(tmp_path_factory.mktemp("demo") / "model")


CONFIGS = {"aggregated": {"workers": 1, "engine": {"max_model_len": 256}},
           "disaggregated": {"prefill": 1, "decode": 1, "connector": "p2p", "engine": {"max_model_len": 256}}}


@pytest.fixture(scope="module", params=list(CONFIGS))
def cluster(request: pytest.FixtureRequest, demo_model: str,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from pdcluster.cluster.bench.sweep_config import parse_sweep
    from pdcluster.cluster.bench.sweep_launch import local_cluster

    sweep = parse_sweep({"model": demo_model, "rates": [1], "ready_timeout_s": 240,
                         "configs": {request.param: CONFIGS[request.param]}})
    log = tmp_path_factory.mktemp("logs") / f"{request.param}.log"
    with local_cluster(sweep.configs[0], sweep, log) as ready:  # exits: SIGTERM by pid, then wait
        yield {**ready, "name": request.param}


@pytest.mark.parametrize("backend", ["pdcluster", "openai"])
def test_bench_serve_against_a_cluster(cluster: dict[str, Any], backend: str, demo_model: str,
                                       tmp_path: pathlib.Path) -> None:
    target = ["--router", cluster["grpc"]] if backend == "pdcluster" else ["--base-url", cluster["http"]]
    argv = ["bench", "serve", "--backend", backend, *target, "--tokenizer", demo_model,
            "--num-prompts", str(NUM_PROMPTS), "--random-input-len", "24", "--random-output-len", str(OUTPUT_LEN),
            "--ignore-eos", "--request-rate", "inf", "--goodput", "ttft:60000", "--percentile-metrics",
            "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(tmp_path),
            "--result-filename", "r.json", "--metadata", f"cluster={cluster['name']}", "--disable-tqdm",
            "--num-warmups", "2"]
    assert main(argv) == 0
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["backend"] == backend and r["num_prompts"] == NUM_PROMPTS and r["request_rate"] == "inf"
    assert r["completed"] == NUM_PROMPTS and r["failed"] == 0, r["errors"]
    assert r["num_warmups"] == 2 and len(r["ttfts"]) == NUM_PROMPTS  # warm-ups are not counted
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])  # a generous SLO: all meet it
    for key in ("median_ttft_ms", "p99_ttft_ms", "p99_itl_ms", "mean_tpot_ms", "p50_e2el_ms", "duration",
                "output_throughput", "total_token_throughput"):
        assert isinstance(r[key], float) and r[key] > 0, key
    # One ITL per streamed chunk after the first, as vLLM counts: a chunk may carry several tokens.
    assert len(r["ttfts"]) == len(r["itls"]) == NUM_PROMPTS and all(0 < len(x) < OUTPUT_LEN for x in r["itls"])
    assert r["cluster"] == cluster["name"] and r["environment"]["metadata"] == {"cluster": cluster["name"]}
    assert r["environment"]["versions"]["pdcluster"] and r["environment"]["machine"]["cpu_count"]
    # Disaggregated: the router adds the prefill leg's token to the decode worker's usage.
    assert r["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN and r["output_lens"] == [OUTPUT_LEN] * NUM_PROMPTS


def test_tiny_sweep_end_to_end(demo_model: str, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(json.dumps({  # JSON is YAML
        "name": "tiny", "model": demo_model, "rates": [4], "ready_timeout_s": 240, "warmup_prompts": 2,
        "repeats": 2,
        "workload": {"random_input_len": 24, "random_output_len": OUTPUT_LEN, "num_prompts": NUM_PROMPTS,
                     "ignore_eos": True, "goodput": ["ttft:60000"], "metric_percentiles": "50,99"},
        "configs": CONFIGS}))
    out = tmp_path / "out"
    assert main(["bench", "sweep", "--config", str(sweep), "--output-dir", str(out)]) == 0
    for name in CONFIGS:
        runs = [json.loads((out / f"{name}-4qps-r{i}.json").read_text()) for i in (1, 2)]
        assert [x["sweep"]["repeat"] for x in runs] == [0, 1] and [x["sweep"]["seed"] for x in runs] == [0, 1]
        assert runs[0]["input_lens"] != runs[1]["input_lens"] or runs[0]["start_times"] != runs[1]["start_times"]
        r = runs[0]
        assert r["completed"] == NUM_PROMPTS and r["failed"] == 0, r["errors"]
        assert r["sweep"]["cluster_warmup"] == runs[1]["sweep"]["cluster_warmup"]  # once per cluster
        assert r["sweep"]["cluster_warmup"]["completed"] == 2
        assert r["sweep"]["config"] == name and r["sweep"]["spec"] == CONFIGS[name]
        assert r["sweep"]["disaggregated"] == (name == "disaggregated") and r["sweep"]["launcher"] == "local"
        assert r["environment"]["sweep"]["config"] == name and r["environment"]["machine"]["cpu_count"]
        assert "PDCLUSTER_READY" in (out / "logs" / f"{name}.log").read_text()
    for png in ("median_ttft_ms", "p99_ttft_ms", "p99_itl_ms", "request_goodput", "sweep"):
        assert (out / f"{png}.png").read_bytes()[:4] == b"\x89PNG"
    summary = json.loads((out / "sweep_summary.json").read_text())
    assert [r["config"] for r in summary["ratios"]] == ["disaggregated"]
    assert [p["repeats"] for p in summary["points"]] == [2, 2]
    assert summary["points"][0]["spread"]["median_ttft_ms"]["n"] == 2
    assert "disaggregated / aggregated" in capsys.readouterr().out
