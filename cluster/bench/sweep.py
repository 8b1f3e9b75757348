"""`pdcluster bench sweep --config SWEEP.yaml`: the same workload against several cluster
configurations at several request rates, e.g. aggregated vs disaggregated.

    for each configuration:  launch the cluster (local `pdcluster serve` or Ray `pdcluster up`)
        warm-up:             `warmup_prompts` requests of the workload's shape, awaited, not measured
        for each rate:
          for each repeat:   `bench serve` in-process -> {config}-{rate}qps[-r{i}].json (+ the sweep record)
        stop the cluster     (also on an error or Ctrl-C: nothing is left running)
    (interleave: true        round i starts each configuration's cluster in turn, order rotated
                             per round, and runs repeat i of every rate on it)
    from the JSONs:          PNG plots (error bars: min..max over repeats), sweep_summary.json,
                             the ratio table of medians vs the baseline

One cluster serves all rates of its configuration: loading a model costs more than a point. Its
first load pays one-off costs (first-shape kernels, allocator growth), hence the warm-up; the
initial test request of every point warms it again before it is measured. Repeat i of a point uses
the workload's seed + i: other prompts and arrival times, so the spread is the run-to-run noise of
the cluster and the machine and no repeat hits a prefix cache that an earlier one filled.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from pdcluster.cluster.bench.sweep_config import (
    ClusterEntry,
    SweepConfig,
    SweepError,
    load_sweep,
    serve_parser,
)
from pdcluster.cluster.bench.sweep_report import (
    format_points_table,
    format_ratio_table,
    load_points,
    ratio_rows,
    write_plots,
    write_summary,
)


def add_sweep_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="sweep YAML (see examples/sweep.yaml)")
    p.add_argument("--output-dir", default=None, help="result JSONs, logs and plots (default: the file's "
                                                      "output_dir, else bench-sweep-DATE)")
    p.add_argument("--launcher", choices=("local", "ray"), default=None,
                   help="local: `pdcluster serve` on this machine (default); ray: `pdcluster up --detach`")
    p.add_argument("--only", default=None, help="comma-separated configuration names to run (default: all)")
    p.add_argument("--interleave", action="store_true",
                   help="rounds instead of one cluster per configuration: round i starts each configuration's "
                        "cluster in turn (order rotated) and runs repeat i on it (the file's `interleave: true`)")
    p.add_argument("--report-only", action="store_true",
                   help="start nothing: re-plot and re-summarize the result JSONs already in the output folder")


def rate_word(rate: float) -> str:
    return "inf" if rate == float("inf") else f"{rate:g}"


def point_filename(config: str, rate: float, repeat: int = 0, repeats: int = 1) -> str:
    """{config}-{rate}qps.json; with repeats, {config}-{rate}qps-r{1..K}.json."""
    return f"{config}-{rate_word(rate)}qps{f'-r{repeat + 1}' if repeats > 1 else ''}.json"


POINT_SEED_STRIDE = 1000  # seed offset between rates (repeats add 1 each)


def serve_args(sweep: SweepConfig, entry: ClusterEntry, rate: float, ready: Mapping[str, Any],
               out_dir: pathlib.Path, repeat: int = 0) -> argparse.Namespace:
    """bench serve's namespace for one point: the workload, then what the sweep owns."""
    args = serve_parser().parse_args([])
    for dest, value in sweep.workload.items():
        setattr(args, dest, value)
    backend = args.backend or "pdcluster"
    args.backend = backend
    if backend == "pdcluster":
        args.router = ready["grpc"]
    else:
        if not ready.get("http"):
            raise SweepError(f"workload.backend: {backend} needs the cluster's HTTP frontend, which is off")
        args.base_url = ready["http"]
    args.tokenizer = args.tokenizer or sweep.model or ready.get("model")
    args.request_rate = rate
    args.save_result = True
    args.result_dir = str(out_dir)
    args.result_filename = point_filename(entry.name, rate, repeat, sweep.repeats)
    # Distinct prompts at every (rate, repeat) point, the same ones for every configuration: with
    # one seed for all rates the later rates would find their prompts in the prefix cache.
    args.seed = args.seed + repeat + POINT_SEED_STRIDE * sweep.rates.index(rate)
    args.label = entry.name
    args.disable_tqdm = True
    return args


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def record_point(path: pathlib.Path, sweep: SweepConfig, entry: ClusterEntry, launcher: str, rate: float,
                 ready: Mapping[str, Any], load_before: list[float] | None, repeat: int = 0,
                 warmup: Mapping[str, Any] | None = None) -> None:
    """Adds the sweep record to a result JSON: which configuration, how launched, the machine's load."""
    import json

    from pdcluster.cluster.bench.result import save_result

    result = json.loads(path.read_text(encoding="utf-8"))
    record = {"name": sweep.name, "config": entry.name, "spec": entry.spec, "cluster": entry.cluster,
              "disaggregated": entry.disaggregated, "launcher": launcher, "rate": rate_word(rate),
              "rates": [rate_word(r) for r in sweep.rates], "workload": sweep.workload, "baseline": sweep.baseline,
              "endpoints": dict(ready), "loadavg_before": load_before, "loadavg_after": _loadavg(),
              "repeat": repeat, "repeats": sweep.repeats, "seed": sweep.workload.get("seed", 0) + repeat,
              "cluster_warmup": dict(warmup) if warmup is not None else None, "file": path.name}
    result["sweep"] = record
    result.setdefault("environment", {})["sweep"] = record
    save_result(result, str(path.parent), path.name)


def warm_up_cluster(sweep: SweepConfig, entry: ClusterEntry, ready: Mapping[str, Any],
                    out_dir: pathlib.Path) -> dict[str, Any] | None:
    """The per-cluster warm-up: `warmup_prompts` requests of the workload's shape (not its prompts),
    all at once, awaited; recorded in every point's sweep record, never measured."""
    from pdcluster.cluster.bench.serve import run_warmup

    if sweep.warmup_prompts <= 0:
        return None
    print(f"\n--- {entry.name}: warm-up, {sweep.warmup_prompts} requests ---", flush=True)
    args = serve_args(sweep, entry, sweep.rates[0], ready, out_dir)
    try:
        run = run_warmup(args, sweep.warmup_prompts)
    except ValueError as e:  # a workload the cluster cannot serve: this configuration fails, the sweep goes on
        raise RuntimeError(f"warm-up: {e}") from None
    completed = sum(r.success for r in run.results)
    if completed == 0:
        errors = [r.error for r in run.results if r.error]
        raise RuntimeError(f"every warm-up request failed: {errors[0] if errors else 'no result'}")
    return {"prompts": sweep.warmup_prompts, "completed": completed, "seconds": round(run.duration, 3)}


def run_config(sweep: SweepConfig, entry: ClusterEntry, launcher: str, out_dir: pathlib.Path,
               repeats: Sequence[int] | None = None) -> list[str]:
    """Runs every rate (each of `repeats`, default all the sweep's) against one cluster; returns the
    failures (the sweep goes on after one)."""
    from pdcluster.cluster.bench.serve import run_serve
    from pdcluster.cluster.bench.sweep_launch import launch

    failures = []
    repeats = range(sweep.repeats) if repeats is None else repeats
    log_name = entry.name if len(repeats) == sweep.repeats else f"{entry.name}-r{repeats[0] + 1}"
    print(f"\n=== {entry.name}: starting the cluster ({launcher}) ===", flush=True)
    with launch(entry, sweep, launcher, out_dir / "logs" / f"{log_name}.log") as ready:
        print(f"=== {entry.name}: ready, gRPC {ready.get('grpc')} HTTP {ready.get('http')} ===", flush=True)
        warmup = warm_up_cluster(sweep, entry, ready, out_dir)
        for rate in sweep.rates:
            for repeat in repeats:
                what = f"{entry.name} at {rate_word(rate)} req/s" + (
                    f", repeat {repeat + 1}/{sweep.repeats}" if sweep.repeats > 1 else "")
                print(f"\n--- {what} ---", flush=True)
                args = serve_args(sweep, entry, rate, ready, out_dir, repeat)
                load_before = _loadavg()
                try:
                    status = run_serve(args)
                except (ValueError, OSError, RuntimeError) as e:
                    failures.append(f"{what}: {e}")
                    print(f"error: {failures[-1]}", file=sys.stderr)
                    continue
                path = out_dir / args.result_filename
                if path.exists():
                    record_point(path, sweep, entry, launcher, rate, ready, load_before, repeat, warmup)
                if status != 0:
                    failures.append(f"{what}: no request completed")
    print(f"=== {entry.name}: cluster stopped ===", flush=True)
    return failures


def schedule(entries: Sequence[ClusterEntry], repeats: int,
             interleave: bool) -> list[tuple[ClusterEntry, range]]:
    """Which cluster starts when, and which repeats it runs. Back to back: each configuration
    once, all repeats. Interleaved: round i runs repeat i of every configuration, starting at
    configuration i (mod their number), so none is always first after a quiet minute or last in a
    warm machine."""
    if not interleave or repeats == 1:
        return [(e, range(repeats)) for e in entries]
    n = len(entries)
    return [(entries[(i + k) % n], range(i, i + 1)) for i in range(repeats) for k in range(n)]


def report(out_dir: pathlib.Path, baseline: str, title: str = "") -> int:
    points = load_points(out_dir)
    if not points:
        print(f"no sweep results in {out_dir}", file=sys.stderr)
        return 1
    plots = write_plots(points, out_dir, title)
    write_summary(points, baseline, out_dir / "sweep_summary.json")
    print("\n" + format_points_table(points))
    print(f"\nratios vs {baseline} (latency: <1 is better; goodput/throughput: >1 is better)")
    print(format_ratio_table(ratio_rows(points, baseline)))
    print(f"\nplots: {', '.join(str(p) for p in plots)}")
    return 0


def run_sweep(args: argparse.Namespace) -> int:
    try:
        sweep = load_sweep(args.config)
        entries = list(sweep.configs)
        if args.only:
            wanted = [s.strip() for s in args.only.split(",") if s.strip()]
            unknown = [w for w in wanted if w not in {e.name for e in entries}]
            if unknown:
                raise SweepError(f"--only: unknown configuration(s) {unknown}; the file has "
                                 f"{', '.join(e.name for e in entries)}")
            entries = [e for e in entries if e.name in wanted]
    except SweepError as e:
        print(f"pdcluster bench sweep: error: {e}", file=sys.stderr)
        return 2
    launcher = args.launcher or sweep.launcher
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = pathlib.Path(args.output_dir or sweep.output_dir or f"bench-sweep-{stamp}")
    if args.report_only:
        return report(out_dir, sweep.baseline, sweep.name)
    out_dir.mkdir(parents=True, exist_ok=True)
    failures: list[str] = []
    for entry, repeats in schedule(entries, sweep.repeats, args.interleave or sweep.interleave):
        try:
            failures += run_config(sweep, entry, launcher, out_dir, repeats)
        except (RuntimeError, OSError, SweepError) as e:  # a cluster that does not start: go on with the next
            failures.append(f"{entry.name}: {e}")
            print(f"error: {failures[-1]}", file=sys.stderr)
    status = report(out_dir, sweep.baseline, sweep.name)
    for failure in failures:
        print(f"failed: {failure}", file=sys.stderr)
    return 1 if failures else status
