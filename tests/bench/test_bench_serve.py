"""`pdcluster bench serve` end to end: flags -> requests to a real SSE server -> table and JSON."""

from __future__ import annotations

import json
import pathlib

import pytest

from pdcluster.cluster import cli
from pdcluster.cluster.bench import add_bench_parser


@pytest.fixture
def main():
    """The top-level `pdcluster` entry point, which must list `bench`."""
    assert callable(add_bench_parser)
    return cli.main


def _saved(result_dir: pathlib.Path) -> dict:
    [path] = result_dir.glob("*.json")
    return json.loads(path.read_text())


def test_random_workload_with_concurrency_cap(main, fake_server, tokenizer_dir, tmp_path, capsys) -> None:
    fake_server.ttft, fake_server.itl = 0.02, 0.005
    rc = main(["bench", "serve", "--base-url", fake_server.url, "--model", "fake-model", "--tokenizer", tokenizer_dir,
               "--num-prompts", "6", "--random-input-len", "16", "--random-output-len", "3", "--max-concurrency", "2",
               "--goodput", "ttft:10000", "tpot:10000", "--percentile-metrics", "ttft,tpot,itl,e2el",
               "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(tmp_path / "res"),
               "--metadata", "cluster=1p1d", "tp=1", "--disable-tqdm", "--ignore-eos", "--label", "agg"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "============ Serving Benchmark Result ============" in out
    assert "P50 E2EL (ms):" in out and "Request goodput (req/s):" in out
    [path] = (tmp_path / "res").glob("agg-infqps-concurrency2-fake-model-*.json")
    r = json.loads(path.read_text())
    assert (r["completed"], r["failed"], r["num_prompts"]) == (6, 0, 6)
    assert r["total_output_tokens"] == 18 and r["output_lens"] == [3] * 6
    assert r["total_input_tokens"] == sum(r["input_lens"])  # the server's prompt_tokens
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])
    assert r["max_concurrency"] == 2 and r["max_concurrent_requests"] <= 2 and fake_server.max_in_flight <= 2
    assert r["mean_ttft_ms"] >= 15 and "p50_ttft_ms" in r and "p99_e2el_ms" in r
    assert r["tp"] == "1" and r["environment"]["metadata"] == {"cluster": "1p1d", "tp": "1"}
    assert len(fake_server.bodies) == 7  # the initial test request, then the six
    prompts = [b["prompt"] for b in fake_server.bodies[1:]]
    assert len(set(prompts)) == 6 and all(b["ignore_eos"] for b in fake_server.bodies)
    ids = fake_server.request_ids
    assert len(set(ids)) == 7 and ids[0].endswith("-probe") and all(i.startswith("bench-") for i in ids)


def test_failures_are_counted_and_reported(main, fake_server, tokenizer_dir, tmp_path, capsys) -> None:
    fake_server.ttft = fake_server.itl = 0.0
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps(x) for x in [
        {"prompt": " fox", "output_len": 2}, {"prompt": "FAIL500", "output_len": 2},
        {"prompt": "FAILSTREAM", "output_len": 2}, {"prompt": " dog", "output_len": 2}]))
    rc = main(["bench", "serve", "--port", fake_server.url.rsplit(":", 1)[1], "--model", "m",
               "--tokenizer", tokenizer_dir, "--dataset-name", "jsonl", "--dataset-path", str(data),
               "--save-result", "--result-dir", str(tmp_path), "--result-filename", "out.json", "--disable-tqdm"])
    captured = capsys.readouterr()
    assert rc == 0
    assert "Failed requests:                         2" in captured.out
    assert "HTTP 500" in captured.err
    r = json.loads((tmp_path / "out.json").read_text())
    assert (r["completed"], r["failed"]) == (2, 2)
    assert r["errors"][0] == "" and r["errors"][1].startswith("HTTP 500") and "worker died" in r["errors"][2]
    assert r["output_lens"] == [2, 0, 0, 2]


def test_everything_failing_exits_nonzero(main, fake_server, tokenizer_dir, tmp_path) -> None:
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "FAIL500"}\n')
    args = ["bench", "serve", "--base-url", fake_server.url, "--model", "m", "--tokenizer", tokenizer_dir,
            "--dataset-name", "jsonl", "--dataset-path", str(data), "--disable-tqdm"]
    assert main(args) == 2  # the initial test request fails: a flag or server problem, said early
    assert main([*args, "--skip-initial-test"]) == 1


def test_trace_replay_keeps_the_schedule(main, fake_server, tokenizer_dir, tmp_path) -> None:
    fake_server.ttft = fake_server.itl = 0.0
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(x) + "\n" for x in [
        {"timestamp": 1000, "input_length": 12, "output_length": 2, "hash_ids": [1, 2]},
        {"timestamp": 1400, "input_length": 10, "output_length": 3, "hash_ids": [1, 3]},
        {"timestamp": 1800, "input_length": 8, "output_length": 1, "hash_ids": [1]}]))
    rc = main(["bench", "serve", "--base-url", fake_server.url, "--model", "m", "--tokenizer", tokenizer_dir,
               "--trace-file", str(trace), "--trace-time-scale", "0.5", "--trace-block-size", "8",
               "--skip-initial-test", "--save-result", "--result-dir", str(tmp_path / "r"), "--disable-tqdm"])
    assert rc == 0
    r = _saved(tmp_path / "r")
    assert r["num_prompts"] == 3 and r["output_lens"] == [2, 3, 1]
    starts = r["start_times"]
    assert starts[1] - starts[0] == pytest.approx(0.2, abs=0.15) and starts[2] >= 0.39
    prompts = [b["prompt"] for b in fake_server.bodies]
    assert prompts[0][: len(prompts[2])] == prompts[2]  # block 1 is shared by all three


def test_request_rate_paces_the_sends(main, fake_server, tokenizer_dir, tmp_path) -> None:
    fake_server.ttft = fake_server.itl = 0.0
    rc = main(["bench", "serve", "--base-url", fake_server.url, "--backend", "openai-chat", "--tokenizer",
               tokenizer_dir, "--num-prompts", "4", "--random-input-len", "8", "--random-output-len", "2",
               "--request-rate", "20", "--burstiness", "inf", "--skip-initial-test", "--save-result",
               "--result-dir", str(tmp_path), "--disable-tqdm"])
    assert rc == 0
    r = _saved(tmp_path)
    assert r["backend"] == "openai-chat" and r["model_id"] == "fake-model" and r["request_rate"] == 20.0
    assert r["burstiness"] == "inf"
    assert r["start_times"][-1] >= 0.19  # the fourth request is due at 4 / 20 s
    assert all("messages" in b for b in fake_server.bodies)


@pytest.mark.parametrize("extra, message", [
    (["--goodput", "ttft"], "--goodput"),
    (["--percentile-metrics", "ttft,foo"], "--percentile-metrics"),
    (["--metric-percentiles", "101"], "--metric-percentiles"),
    (["--metadata", "novalue"], "--metadata"),
    (["--request-rate", "0"], "--request-rate"),
    (["--dataset-name", "jsonl"], "--dataset-path"),
])
def test_flag_errors_are_reported_plainly(main, tokenizer_dir, capsys, extra, message) -> None:
    rc = main(["bench", "serve", "--tokenizer", tokenizer_dir, "--num-prompts", "2", "--random-input-len", "4",
               "--disable-tqdm", *extra])
    assert rc == 2
    assert message in capsys.readouterr().err


def test_a_tokenizer_is_required(main, capsys, tmp_path) -> None:
    assert main(["bench", "serve"]) == 2
    assert "--tokenizer" in capsys.readouterr().err
    assert main(["bench", "serve", "--tokenizer", str(tmp_path)]) == 2
    assert "tokenizer.json" in capsys.readouterr().err


def test_warmups_are_sent_first_and_not_counted(main, fake_server, tokenizer_dir, tmp_path, capsys) -> None:
    fake_server.ttft, fake_server.itl = 0.01, 0.0
    rc = main(["bench", "serve", "--base-url", fake_server.url, "--tokenizer", tokenizer_dir, "--num-prompts", "3",
               "--random-input-len", "12", "--random-output-len", "2", "--num-warmups", "4", "--max-concurrency", "2",
               "--save-result", "--result-dir", str(tmp_path), "--result-filename", "w.json", "--disable-tqdm"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "Warming up with 4 requests..." in out and "Warmup run completed: 4/4" in out
    assert out.index("Warmup run completed") < out.index("Serving Benchmark Result")
    r = json.loads((tmp_path / "w.json").read_text())
    assert (r["num_warmups"], r["completed"], r["num_prompts"], len(r["ttfts"])) == (4, 3, 3, 3)
    ids = fake_server.request_ids
    assert len(ids) == 1 + 4 + 3 and ids[0].endswith("-probe")
    assert all("-warmup-" in i for i in ids[1:5]) and not any("-warmup-" in i for i in ids[5:])
    assert fake_server.max_in_flight <= 2  # --max-concurrency caps the warm-up too
    # The same shape (max_tokens, about the same prompt length), other prompts: no prefix-cache hits.
    warm, measured = fake_server.bodies[1:5], fake_server.bodies[5:]
    assert all(b["max_tokens"] == 2 for b in warm)
    assert not {b["prompt"] for b in warm} & {b["prompt"] for b in measured}


def test_warmups_of_a_file_reuse_its_prompts(main, fake_server, tokenizer_dir, tmp_path) -> None:
    fake_server.ttft = fake_server.itl = 0.0
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": " fox", "output_len": 1}\n{"prompt": " dog", "output_len": 2}\n')
    rc = main(["bench", "serve", "--base-url", fake_server.url, "--tokenizer", tokenizer_dir, "--dataset-name",
               "jsonl", "--dataset-path", str(data), "--num-warmups", "3", "--skip-initial-test", "--disable-tqdm"])
    assert rc == 0
    assert sorted(b["prompt"] for b in fake_server.bodies[:3]) == [" dog", " fox", " fox"]
    assert len(fake_server.bodies) == 5


def test_negative_warmups_are_refused(main, tokenizer_dir, capsys) -> None:
    assert main(["bench", "serve", "--tokenizer", tokenizer_dir, "--num-prompts", "2", "--random-input-len", "4",
                 "--num-warmups", "-1", "--disable-tqdm"]) == 2
    assert "--num-warmups" in capsys.readouterr().err
