"""`bench sweep` without a cluster: the sweep file's validation (errors name the field), the flags a
configuration becomes, and the ratio table / plots / summary made from recorded result JSONs."""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any

import pytest

from pdcluster.cluster.bench.sweep_config import SweepError, load_sweep, parse_sweep
from pdcluster.cluster.bench.sweep_report import (
    Point,
    Stat,
    aggregate,
    first_gap_split,
    format_points_table,
    format_ratio_table,
    group_points,
    load_points,
    ratio_rows,
    write_plots,
    write_summary,
)

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "sweep.yaml"


def _sweep(**over: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "rates": [1, 2.5, "inf"],
        "workload": {"random-input-len": 256, "random_output_len": 64, "num_prompts": 8, "ignore_eos": True,
                     "goodput": ["ttft:2000", "tpot:200"]},
        "configs": {"aggregated": {"workers": 2}, "disaggregated": {"prefill": 1, "decode": 1, "connector": "p2p"}},
    }
    raw.update(over)
    return raw


def test_parses_a_sweep() -> None:
    s = parse_sweep(_sweep(model="/m", baseline="aggregated"))
    assert [c.name for c in s.configs] == ["aggregated", "disaggregated"]
    assert s.rates == (1.0, 2.5, math.inf)
    assert s.workload == {"random_input_len": 256, "random_output_len": 64, "num_prompts": 8, "ignore_eos": True,
                          "goodput": ["ttft:2000", "tpot:200"]}
    agg, dis = s.configs
    assert agg.cluster == {"pools": {"both": {"instances": 2}}, "model": "/m"}
    assert not agg.disaggregated and dis.disaggregated
    assert dis.cluster["connector"] == {"name": "p2p", "options": {}}
    assert s.baseline == "aggregated" and s.launcher == "local"
    assert s.warmup_prompts == 4 and s.repeats == 1  # a warm-up by default, one run per point
    s = parse_sweep(_sweep(warmup_prompts=0, repeats=3))
    assert s.warmup_prompts == 0 and s.repeats == 3


def test_example_files_are_valid() -> None:
    s = load_sweep(str(EXAMPLE))
    assert {c.name for c in s.configs} >= {"aggregated", "disaggregated"}
    smoke = load_sweep(str(EXAMPLE.with_name("sweep-ray-smoke.yaml")))
    assert smoke.launcher == "ray" and smoke.model is None and smoke.ray["address"] == "local"
    for path in sorted(EXAMPLE.parent.glob("sweep*.yaml")):  # every shipped sweep file parses
        assert load_sweep(str(path)).configs, path
    aware = load_sweep(str(EXAMPLE.with_name("sweep-pinned-loadaware.yaml")))
    assert aware.interleave and {c.name: c.cluster.get("router", {}).get("disagg_max_decode_inflight")
                                 for c in aware.configs}["loadaware-inflight1"] == 1


@pytest.mark.parametrize("over, field", [
    ({"rates": []}, "rates:"),
    ({"rates": [1, -2]}, "rates[1]:"),
    ({"rates": [1, "fast"]}, "rates[1]:"),
    ({"configs": {}}, "configs:"),
    ({"configs": {"a": {"workers": 0}}}, "configs.a.workers:"),
    ({"configs": {"a": {"workers": 1, "prefill": 1}}}, "configs.a:"),
    ({"configs": {"a": {"prefill": 1}}}, "configs.a:"),
    ({"configs": {"a": {"prefill": 1, "decode": "two"}}}, "configs.a.decode:"),
    ({"configs": {"a": {"workers": 1, "gpus": 1}}}, "configs.a.gpus:"),
    ({"configs": {"a/b": {"workers": 1}}}, "configs.a/b:"),
    ({"configs": {"a": {"workers": 1, "engine": {"no_such_flag": 1}}}}, "configs.a: pools.both.engine"),
    ({"configs": {"a": {"workers": 1, "decode_engine": {"max_num_seqs": 8}}}}, "configs.a.decode_engine:"),
    ({"configs": {"a": {"prefill": 1, "decode": 1, "decode_engine": [1]}}}, "configs.a.decode_engine:"),
    ({"configs": {"a": {"prefill": 1, "decode": 1, "engine": "big"}}}, "configs.a.engine:"),
    ({"configs": {"a": {"prefill": 1, "decode": 1, "prefill_engine": {"no_such_flag": 1}}}},
     "configs.a: pools.prefill.engine"),
    ({"configs": {"a": {"workers": 1, "placement": {"both": {"strategy": "diagonal"}}}}},
     "configs.a: pools.both.placement.strategy"),
    ({"configs": {"a": {"workers": 1, "placement": {"decode": {}}}}}, "configs.a.placement.decode:"),
    ({"workload": {"random_input_len": "long"}}, "workload.random_input_len:"),
    ({"workload": {"dataset_name": "sharegpt-v9"}}, "workload.dataset_name:"),
    ({"workload": {"ignore_eos": "yes"}}, "workload.ignore_eos:"),
    ({"workload": {"no_such": 1}}, "workload.no_such:"),
    ({"workload": {"request_rate": 3}}, "workload.request_rate:"),
    ({"baseline": "nope"}, "baseline:"),
    ({"launcher": "k8s"}, "launcher:"),
    ({"colour": "blue"}, "colour:"),
    ({"ray": {"adress": "auto"}}, "ray.adress:"),
    ({"warmup_prompts": -1}, "warmup_prompts:"),
    ({"warmup_prompts": "some"}, "warmup_prompts:"),
    ({"repeats": 0}, "repeats:"),
    ({"repeats": 1.5}, "repeats:"),
])
def test_errors_name_the_field(over: dict[str, Any], field: str) -> None:
    with pytest.raises(SweepError) as e:
        parse_sweep(_sweep(**over))
    assert str(e.value).startswith(field), str(e.value)


def test_load_sweep_errors(tmp_path: pathlib.Path) -> None:
    with pytest.raises(SweepError, match="cannot read"):
        load_sweep(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("configs: [unclosed\n")
    with pytest.raises(SweepError, match="not valid YAML"):
        load_sweep(str(bad))
    bad.write_text("- a list\n")
    with pytest.raises(SweepError, match="sweep file: must be a mapping"):
        load_sweep(str(bad))


def test_serve_flags_of_a_configuration() -> None:
    from pdcluster.cluster.bench.sweep_launch import serve_argv

    s = parse_sweep(_sweep(model="/m", configs={
        "agg": {"workers": 2, "engine": {"max_model_len": 1024}, "policy": "round_robin"},
        "dis": {"prefill": 1, "decode": 2, "connector": "p2p", "connector_options": {"transport": "tcp"}}}))
    agg, dis = (serve_argv(c) for c in s.configs)
    assert agg[:4] == ["serve", "--grpc-port", "0", "--http-port"]
    assert agg[agg.index("--workers") + 1] == "2" and agg[agg.index("--policy") + 1] == "round_robin"
    assert "--max-model-len 1024" in agg[agg.index("--worker-args") + 1]
    assert dis[dis.index("--prefill") + 1] == "1" and dis[dis.index("--decode") + 1] == "2"
    assert dis[dis.index("--connector") + 1] == "p2p"
    assert '{"transport": "tcp"}' in dis[dis.index("--worker-args") + 1]


def test_a_pools_own_engine_options_reach_only_that_pool() -> None:
    """decode_engine / prefill_engine over the shared `engine`: the cluster config holds the merge,
    and `serve` gets the pool's own options as --decode-FLAG / --prefill-FLAG (which is what
    forwarded_engine hands that pool's workers), the shared ones as --worker-args."""
    from pdcluster.cluster.bench.sweep_launch import serve_argv
    from pdcluster.cluster.cli import build_parser
    from pdcluster.cluster.worker_flags import forwarded_engine

    s = parse_sweep(_sweep(model="/m", configs={"dis": {
        "prefill": 1, "decode": 1, "engine": {"max_model_len": 1024, "max_num_batched_tokens": 2048},
        "decode_engine": {"long_prefill_token_threshold": 32, "max_num_batched_tokens": 256},
        "prefill_engine": {"enforce_eager": True, "no_prefix_caching": True}}}))
    (dis,) = s.configs
    assert dis.cluster["pools"]["decode"]["engine"] == {"max_model_len": 1024, "max_num_batched_tokens": 256,
                                                        "long_prefill_token_threshold": 32}
    assert dis.cluster["pools"]["prefill"]["engine"] == {"max_model_len": 1024, "max_num_batched_tokens": 2048,
                                                         "enforce_eager": True, "no_prefix_caching": True}
    argv = serve_argv(dis)
    assert argv[argv.index("--worker-args") + 1] == "--max-model-len 1024"
    args = build_parser().parse_args(argv)
    assert forwarded_engine(args, "decode") == {"max_num_batched_tokens": 256, "long_prefill_token_threshold": 32}
    assert forwarded_engine(args, "prefill") == {"max_num_batched_tokens": 2048, "enforce_eager": True,
                                                 "no_prefix_caching": True}


def test_pinned_configuration_asks_serve_to_pin_and_is_local_only() -> None:
    from pdcluster.cluster.bench.sweep_launch import serve_argv

    s = parse_sweep(_sweep(configs={"pinned": {"prefill": 1, "decode": 1, "pin_cpus": True},
                                    "shared": {"workers": 2}}))
    pinned, shared = s.configs
    assert pinned.pinned and "--pin-cpus" in serve_argv(pinned)
    assert not shared.pinned and "--pin-cpus" not in serve_argv(shared)
    with pytest.raises(SweepError, match=r"configs\.pinned\.pin_cpus: must be true or false"):
        parse_sweep(_sweep(configs={"pinned": {"workers": 1, "pin_cpus": "yes"}}))
    with pytest.raises(SweepError, match=r"configs\.pinned\.pin_cpus: only the local launcher"):
        parse_sweep(_sweep(launcher="ray", configs={"pinned": {"workers": 1, "pin_cpus": True}}))


def test_conditional_disaggregation_threshold_reaches_the_router() -> None:
    from pdcluster.cluster.bench.sweep_launch import serve_argv

    s = parse_sweep(_sweep(configs={"conditional": {"prefill": 1, "decode": 1, "disagg_threshold": 256},
                                    "always": {"prefill": 1, "decode": 1}}))
    conditional, always = s.configs
    argv = serve_argv(conditional)
    assert argv[argv.index("--disagg-threshold") + 1] == "256"
    assert conditional.cluster["router"]["disagg_min_uncached_tokens"] == 256
    assert "--disagg-threshold" not in serve_argv(always)
    with pytest.raises(SweepError, match=r"configs\.agg\.disagg_threshold: needs prefill and decode pools"):
        parse_sweep(_sweep(configs={"agg": {"workers": 2, "disagg_threshold": 256}}))
    with pytest.raises(SweepError, match=r"disagg_min_uncached_tokens"):
        parse_sweep(_sweep(configs={"neg": {"prefill": 1, "decode": 1, "disagg_threshold": -1}}))


def test_prefill_backlog_limit_reaches_the_router() -> None:
    from pdcluster.cluster.bench.sweep_launch import serve_argv

    (aware,) = parse_sweep(_sweep(configs={"aware": {"prefill": 1, "decode": 1,
                                                     "disagg_max_prefill_backlog": 512}})).configs
    argv = serve_argv(aware)
    assert argv[argv.index("--disagg-max-prefill-backlog") + 1] == "512"
    assert aware.cluster["router"]["disagg_max_prefill_backlog_tokens"] == 512
    with pytest.raises(SweepError, match=r"configs\.agg\.disagg_max_prefill_backlog: needs prefill and decode"):
        parse_sweep(_sweep(configs={"agg": {"workers": 2, "disagg_max_prefill_backlog": 512}}))
    with pytest.raises(SweepError, match=r"disagg_max_prefill_backlog_tokens"):
        parse_sweep(_sweep(configs={"neg": {"prefill": 1, "decode": 1, "disagg_max_prefill_backlog": -1}}))
    (limited,) = parse_sweep(_sweep(configs={"lim": {"prefill": 1, "decode": 1, "disagg_max_prefill_backlog": 256,
                                                     "disagg_max_decode_inflight": 0}})).configs
    argv = serve_argv(limited)
    assert argv[argv.index("--disagg-max-decode-inflight") + 1] == "0"
    assert "--disagg-max-decode-inflight" not in serve_argv(aware)
    with pytest.raises(SweepError, match=r"disagg_max_decode_inflight: .*needs"):
        parse_sweep(_sweep(configs={"alone": {"prefill": 1, "decode": 1, "disagg_max_decode_inflight": 1}}))


def test_ray_config_is_a_valid_cluster_config() -> None:
    from pdcluster.cluster.bench.sweep_launch import ray_config
    from pdcluster.cluster.config import ClusterConfig

    s = parse_sweep(_sweep(ray={"num_cpus": 4}, configs={"dis": {
        "prefill": 1, "decode": 1, "placement": {"prefill": {"strategy": "spread", "resource": "prefill_node"}}}}))
    cfg = ClusterConfig.from_dict(ray_config(s.configs[0], s, "ns-dis"))
    assert cfg.namespace == "ns-dis" and cfg.pools["prefill"].placement.resource == "prefill_node"
    assert cfg.router.grpc_port == 0 and cfg.num_cpus == 4


def test_serve_args_of_a_point(tmp_path: pathlib.Path) -> None:
    from pdcluster.cluster.bench.sweep import serve_args

    s = parse_sweep(_sweep(model="/m", workload={"backend": "openai", "num_prompts": 3}))
    ready = {"grpc": "127.0.0.1:1", "http": "http://127.0.0.1:2"}
    args = serve_args(s, s.configs[1], 2.5, ready, tmp_path)
    assert args.base_url == "http://127.0.0.1:2" and args.request_rate == 2.5 and args.num_prompts == 3
    assert args.tokenizer == "/m" and args.save_result and args.result_filename == "disaggregated-2.5qps.json"
    s = parse_sweep(_sweep())
    args = serve_args(s, s.configs[0], math.inf, {**ready, "model": "/served"}, tmp_path)
    assert args.router == "127.0.0.1:1" and args.tokenizer == "/served" and args.result_filename.endswith("-infqps.json")
    # Repeats: one file each, and other prompts and arrivals (seed + repeat).
    s = parse_sweep(_sweep(repeats=3, workload={"seed": 7}))
    args = serve_args(s, s.configs[0], 1.0, ready, tmp_path, repeat=2)
    assert args.result_filename == "aggregated-1qps-r3.json" and args.seed == 9
    assert serve_args(s, s.configs[0], 1.0, ready, tmp_path).seed == 7
    # Rates: other prompts too (the prefix cache would serve a later rate's repeated prompts), the
    # same for every configuration at one point.
    seeds = {(c.name, r): serve_args(s, c, r, ready, tmp_path).seed for c in s.configs for r in (1.0, 2.5, math.inf)}
    assert len({seeds["aggregated", r] for r in (1.0, 2.5, math.inf)}) == 3
    assert all(seeds["aggregated", r] == seeds["disaggregated", r] for r in (1.0, 2.5, math.inf))


def test_aggregate_by_hand() -> None:
    # [1, 2, 3, 10]: median (2 + 3) / 2; mean 4, squared deviations 9 + 4 + 1 + 36 = 50, std sqrt(50 / 3).
    st = aggregate([3.0, 1.0, None, 2.0, 10.0])
    assert st == Stat(median=2.5, min=1.0, max=10.0, std=pytest.approx(4.0824829), n=4)
    assert aggregate([5.0]) == Stat(5.0, 5.0, 5.0, 0.0, 1)
    assert aggregate([7.0, 1.0, 4.0]) == Stat(4.0, 1.0, 7.0, 3.0, 3)  # deviations 3, 3, 0: sqrt(18 / 2)
    assert aggregate([None, float("nan")]) is None and aggregate([]) is None


# -- reports from recorded results ---------------------------------------------------------------

def _result(config: str, rate: float | str, ttft: float, itl: float, goodput: float | None,
            repeat: int = 0) -> dict[str, Any]:
    return {"request_rate": rate, "completed": 4, "failed": 0, "median_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft,
            "p99_itl_ms": itl, "request_goodput": goodput, "output_throughput": 100.0,
            "sweep": {"config": config, "file": f"{config}-{rate}qps.json", "repeat": repeat}}


@pytest.fixture
def recorded(tmp_path: pathlib.Path) -> pathlib.Path:
    rows = [("aggregated", 1, 100.0, 10.0, 1.0), ("aggregated", 2, 200.0, 20.0, 1.5),
            ("disaggregated", 1, 50.0, 20.0, 1.0), ("disaggregated", 2, 50.0, 10.0, 2.0),
            ("disaggregated", "inf", 80.0, 10.0, None)]  # no baseline at inf: no ratio row
    for config, rate, *values in rows:
        (tmp_path / f"{config}-{rate}qps.json").write_text(json.dumps(_result(config, rate, *values)))
    (tmp_path / "not-a-sweep.json").write_text(json.dumps({"request_rate": 1}))
    (tmp_path / "broken.json").write_text("{")
    return tmp_path


def test_ratio_rows_and_table(recorded: pathlib.Path) -> None:
    points = load_points(recorded)
    assert sorted((p.config, p.rate) for p in points) == [
        ("aggregated", 1.0), ("aggregated", 2.0), ("disaggregated", 1.0), ("disaggregated", 2.0),
        ("disaggregated", math.inf)]
    rows = ratio_rows(points, "aggregated")
    assert [(r["rate"], r["config"]) for r in rows] == [(1.0, "disaggregated"), (2.0, "disaggregated")]
    assert rows[0]["median_ttft_ms"] == pytest.approx(0.5) and rows[0]["p99_itl_ms"] == pytest.approx(2.0)
    assert rows[1]["median_ttft_ms"] == pytest.approx(0.25) and rows[1]["request_goodput"] == pytest.approx(4 / 3)
    table = format_ratio_table(rows)
    assert "disaggregated / aggregated" in table and "0.25x" in table and "1.33x" in table
    assert "no ratios" in format_ratio_table([])


def test_plots_and_summary(recorded: pathlib.Path) -> None:
    points = load_points(recorded)
    paths = write_plots(points, recorded / "plots", "test")
    assert {p.name for p in paths} == {"median_ttft_ms.png", "p99_ttft_ms.png", "p99_itl_ms.png", "p99_tpot_ms.png",
                                       "p99_itl_after_first_ms.png", "request_goodput.png", "sweep.png"}
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = write_summary(points, "aggregated", recorded / "sweep_summary.json")
    assert json.loads((recorded / "sweep_summary.json").read_text()) == summary
    assert len(summary["points"]) == 5 and summary["ratios"][0]["rate"] == "1"


def test_first_gap_is_reported_apart_from_the_later_gaps() -> None:
    """A disaggregated request's first gap holds the hand-off: one slow first gap per request can
    set ITL p99 on its own, and the derived metrics tell that apart from slow decode steps."""
    # 4 requests, first gaps 30-60 ms, 99 later gaps of 10 ms each, one 20 ms straggler.
    itls = [[0.03 + 0.01 * i] + [0.010] * 99 for i in range(4)]
    itls[2][50] = 0.020
    result = _result("disaggregated", 1, 50.0, 40.0, 1.0)
    result["itls"] = itls
    point = Point("disaggregated", 1.0, result)
    first, later = first_gap_split(itls)
    assert first == pytest.approx([0.03, 0.04, 0.05, 0.06]) and len(later) == 4 * 99
    assert point.value("p50_first_gap_ms") == pytest.approx(45.0)
    # numpy's linear percentile of 395 x 10 ms and one 20 ms: still 10 ms at p99.
    assert point.value("p99_itl_after_first_ms") == pytest.approx(10.0)
    itls[1][1:] = [0.025] * 99  # slow decode steps throughout one request do show
    assert point.value("p99_itl_after_first_ms") == pytest.approx(25.0)
    # Files without per-request lists (or with odd ones) give no value, not a made-up one.
    assert Point("a", 1.0, {"itls": None}).value("p50_first_gap_ms") is None
    assert Point("a", 1.0, {"itls": [[], []]}).value("p99_itl_after_first_ms") is None
    assert Point("a", 1.0, {"itls": [0.1]}).value("p50_first_gap_ms") is None


@pytest.fixture
def repeated(tmp_path: pathlib.Path) -> pathlib.Path:
    """Three repeats per point; files named as the sweep names them, written out of order."""
    rows = [("aggregated", 1, [(100.0, 10.0, 1.0), (140.0, 30.0, 0.8), (120.0, 20.0, 0.9)]),
            ("disaggregated", 1, [(60.0, 5.0, 1.0), (40.0, 5.0, 1.0), (50.0, 8.0, 0.9)])]
    for config, rate, reps in rows:
        for i, values in reversed(list(enumerate(reps))):
            r = _result(config, rate, *values, repeat=i)
            r["sweep"]["file"] = f"{config}-{rate}qps-r{i + 1}.json"
            (tmp_path / r["sweep"]["file"]).write_text(json.dumps(r))
    return tmp_path


def test_repeats_are_aggregated(repeated: pathlib.Path) -> None:
    points = load_points(repeated)
    groups = group_points(points)
    assert [(g.config, g.rate, [p.repeat for p in g.points]) for g in groups] == [
        ("aggregated", 1.0, [0, 1, 2]), ("disaggregated", 1.0, [0, 1, 2])]
    agg, dis = groups
    assert agg.stat("median_ttft_ms") == Stat(120.0, 100.0, 140.0, 20.0, 3)  # deviations 20, 20, 0
    assert agg.stat("p99_ttft_ms") == Stat(240.0, 200.0, 280.0, 40.0, 3)
    assert dis.value("p99_itl_ms") == 5.0 and agg.total("completed") == 12
    # Ratios of medians: 50 / 120 and 5 / 20; goodput 1.0 / 0.9.
    [row] = ratio_rows(points, "aggregated")
    assert row["median_ttft_ms"] == pytest.approx(50 / 120) and row["p99_itl_ms"] == pytest.approx(0.25)
    assert row["request_goodput"] == pytest.approx(1 / 0.9)
    table = format_points_table(points)
    assert "120.0 [100.0-140.0]" in table and "50.0 [40.0-60.0]" in table and "  3  " in table
    summary = write_summary(points, "aggregated", repeated / "sweep_summary.json")
    p0 = summary["points"][0]
    assert p0["repeats"] == 3 and p0["median_ttft_ms"] == 120.0 and p0["completed"] == 12
    assert p0["spread"]["median_ttft_ms"] == {"min": 100.0, "max": 140.0, "std": 20.0, "n": 3}
    assert p0["files"] == [f"aggregated-1qps-r{i}.json" for i in (1, 2, 3)]
    paths = write_plots(points, repeated, "repeats")  # error bars: min..max
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)


def test_report_only_replots_recorded_results_without_starting_anything(
        recorded: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pdcluster.cluster.cli import main

    cfg = recorded / "s.yaml"  # a real launch of this would fail: no such model
    cfg.write_text("model: /nonexistent/model\nrates: [1, 2]\nbaseline: aggregated\n"
                   "configs: {aggregated: {workers: 2}, disaggregated: {prefill: 1, decode: 1}}\n")
    assert main(["bench", "sweep", "--config", str(cfg), "--output-dir", str(recorded), "--report-only"]) == 0
    out = capsys.readouterr().out
    assert "disaggregated / aggregated" in out and "TPOT p99 (ms)" in out
    assert json.loads((recorded / "sweep_summary.json").read_text())["baseline"] == "aggregated"
    assert (recorded / "p99_itl_after_first_ms.png").read_bytes()[:4] == b"\x89PNG"
    empty = recorded / "empty"
    assert main(["bench", "sweep", "--config", str(cfg), "--output-dir", str(empty), "--report-only"]) == 1
    assert "no sweep results" in capsys.readouterr().err and not empty.exists()


def test_cli_reports_bad_files_without_starting_anything(tmp_path: pathlib.Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from pdcluster.cluster.cli import main

    bad = tmp_path / "s.yaml"
    bad.write_text("rates: [1]\nconfigs: {agg: {workers: 0}}\n")
    assert main(["bench", "sweep", "--config", str(bad), "--output-dir", str(tmp_path / "out")]) == 2
    assert "configs.agg.workers: must be a positive integer" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_clusters_compile_before_they_report_ready(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdcluster.cluster.bench.sweep_launch import steady_env

    monkeypatch.delenv("PDCLUSTER_COMPILE_START", raising=False)
    assert steady_env()["PDCLUSTER_COMPILE_START"] == "wait"
    monkeypatch.setenv("PDCLUSTER_COMPILE_START", "background")  # the user's choice wins
    assert steady_env()["PDCLUSTER_COMPILE_START"] == "background"


def test_interleaved_rounds_rotate_the_configurations() -> None:
    from pdcluster.cluster.bench.sweep import schedule

    configs = parse_sweep(_sweep(configs={"a": {"workers": 2}, "b": {"prefill": 1, "decode": 1},
                                          "c": {"workers": 1}})).configs
    plan = [(e.name, list(r)) for e, r in schedule(configs, 3, interleave=True)]
    assert plan == [("a", [0]), ("b", [0]), ("c", [0]),
                    ("b", [1]), ("c", [1]), ("a", [1]),
                    ("c", [2]), ("a", [2]), ("b", [2])]
    # Every (config, repeat) exactly once, as back to back:
    back = [(e.name, list(r)) for e, r in schedule(configs, 3, interleave=False)]
    assert back == [("a", [0, 1, 2]), ("b", [0, 1, 2]), ("c", [0, 1, 2])]
    assert sorted((n, i) for n, r in plan for i in r) == sorted((n, i) for n, r in back for i in r)
    assert [(e.name, list(r)) for e, r in schedule(configs, 1, interleave=True)] == [("a", [0]), ("b", [0]), ("c", [0])]


def test_interleave_field_is_a_boolean() -> None:
    assert parse_sweep(_sweep(interleave=True)).interleave is True
    assert parse_sweep(_sweep()).interleave is False
    with pytest.raises(SweepError, match=r"^interleave: must be true or false, got 'yes'"):
        parse_sweep(_sweep(interleave="yes"))
