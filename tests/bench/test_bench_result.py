from __future__ import annotations

import json
import math
import pathlib
from datetime import datetime

import pytest

from pdcluster.cluster.bench.environment import collect_environment, parse_metadata
from pdcluster.cluster.bench.metrics import compute_metrics
from pdcluster.cluster.bench.report import format_summary
from pdcluster.cluster.bench.request import RequestResult
from pdcluster.cluster.bench.result import build_result, default_filename, percentile_word, save_result

VLLM_FIELDS = [
    "date", "backend", "model_id", "tokenizer_id", "num_prompts", "request_rate", "burstiness",
    "max_concurrency", "duration", "completed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    "input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors",
    "max_output_tokens_per_s", "max_concurrent_requests",
] + [f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "std", "p99", "p99.9")]


def _result(**overrides):
    results = [
        RequestResult(prompt_len=5, success=True, output_len=3, ttft=0.1, itl=[0.02, 0.03], latency=0.15,
                      start_time=10.0, generated_text=" a b c"),
        RequestResult(prompt_len=6, success=False, latency=0.01, start_time=10.5, error="HTTP 503: busy"),
    ]
    metrics = compute_metrics(results, 1.0, [99, 99.9], {"ttft": 500})
    kwargs = dict(metrics=metrics, results=results, run_start=9.5, backend="openai", model_id="org/Tiny-1B",
                  tokenizer_id="/models/tiny", num_prompts=2, request_rate=math.inf, burstiness=1.0,
                  max_concurrency=None, metadata={"cluster": "1p1d"},
                  environment=collect_environment({"cluster": "1p1d"}, ["pdcluster", "bench", "serve"]),
                  date=datetime(2025, 1, 2, 3, 4, 5))
    kwargs.update(overrides)
    return build_result(**kwargs)


def test_vllm_fields_and_values() -> None:
    r = _result()
    missing = [f for f in VLLM_FIELDS if f not in r]
    assert not missing
    assert r["date"] == "20250102-030405"
    assert r["request_rate"] == "inf"  # JSON has no infinity; vLLM writes the string
    assert r["cluster"] == "1p1d"  # --metadata lands at the top level, as in vLLM
    assert (r["completed"], r["failed"]) == (1, 1)
    assert r["request_goodput"] == pytest.approx(1.0)
    assert r["input_lens"] == [5, 6] and r["output_lens"] == [3, 0]
    assert r["ttfts"] == [0.1, 0.0] and r["itls"] == [[0.02, 0.03], []]
    assert r["errors"] == ["", "HTTP 503: busy"]
    assert r["start_times"] == pytest.approx([0.5, 1.0])
    assert r["mean_ttft_ms"] == pytest.approx(100.0) and r["p99.9_itl_ms"] == pytest.approx(29.99)
    json.dumps(r, allow_nan=False)


def test_environment_record() -> None:
    env = _result()["environment"]
    assert env["command"] == "pdcluster bench serve"
    assert env["metadata"] == {"cluster": "1p1d"}
    assert env["machine"]["cpu_count"] >= 1 and env["machine"]["cpu_model"]
    assert isinstance(env["machine"]["gpus"], list)
    assert env["versions"]["pdcluster"] and env["versions"]["python"] and env["hostname"]


def test_parse_metadata() -> None:
    assert parse_metadata(["a=1", " b = x=y "]) == {"a": "1", "b": "x=y"}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_metadata(["novalue"])


def test_filenames_and_save(tmp_path: pathlib.Path) -> None:
    r = _result()
    assert default_filename(r) == "openai-infqps-Tiny-1B-20250102-030405.json"
    r2 = _result(request_rate=4.0, max_concurrency=8, model_id=None)
    assert default_filename(r2, "agg") == "agg-4.0qps-concurrency8-model-20250102-030405.json"
    path = save_result(r, str(tmp_path / "out"), None, None)
    assert path.parent == tmp_path / "out" and json.loads(path.read_text())["backend"] == "openai"
    named = save_result(r, str(tmp_path), "x.json")
    assert named == tmp_path / "x.json" and not list(tmp_path.glob(".*.tmp"))


def test_percentile_words() -> None:
    assert [percentile_word(p) for p in (99.0, 50, 99.9)] == ["99", "50", "99.9"]


def test_summary_table_layout() -> None:
    r = _result()
    results = [RequestResult(prompt_len=5, success=True, output_len=3, ttft=0.1, itl=[0.02, 0.03], latency=0.15,
                             start_time=10.0)]
    metrics = compute_metrics(results, 2.0, [50, 99], {"ttft": 500})
    text = format_summary(metrics, ["ttft", "tpot", "itl", "e2el"], max_concurrency=4, request_rate=2.0)
    lines = text.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[-1] == "=" * 50
    assert "Successful requests:                     1         " in lines
    assert "Maximum request concurrency:             4         " in lines
    assert "Request rate configured (RPS):           2.00      " in lines
    assert "Request goodput (req/s):                 0.50      " in lines
    assert "---------------Time to First Token----------------" in lines
    assert "-----Time per Output Token (excl. 1st token)------" in lines
    assert "Mean TTFT (ms):                          100.00    " in lines
    assert "P99 E2EL (ms):                           150.00    " in lines
    assert any(line.startswith("P50 ITL (ms):") for line in lines)
    assert r  # the result builder and the table read the same metrics
    order = [line for line in lines if line.startswith("Mean ")]
    assert [line.split()[1] for line in order] == ["TTFT", "TPOT", "ITL", "E2EL"]
    reordered = format_summary(metrics, ["e2el", "ttft"])
    assert reordered.index("Mean TTFT") < reordered.index("Mean E2EL")  # vLLM's order, not the flag's
    no_goodput = format_summary(compute_metrics(results, 2.0, [99]), ["ttft"])
    assert "goodput" not in no_goodput and "Request rate configured" not in no_goodput
