"""What a sweep leaves behind, computed from its result JSONs alone (so a sweep can be re-plotted
or compared later without rerunning it): the points, the PNG plots, and the ratio table of every
configuration against the baseline at each rate.

Ratios are other / baseline: below 1 is better for latencies, above 1 better for goodput and
throughput.

With `repeats: K` a (config, rate) point has K result JSONs: a Group. Its value of a metric is the
median over the repeats (what the tables, ratios and plot lines show), with min, max and the sample
standard deviation beside it (the plots' error bars span min..max).

Two metrics are derived from the per-request `itls` lists rather than read from a summary field,
because in a disaggregated run one gap per request is not like the others: the gap from the
first token (the prefill leg's) to the second (the decode leg's first step) holds the KV hand-off.
  p50_first_gap_ms       median over requests of that first gap
  p99_itl_after_first_ms ITL p99 over every later gap (each request's first gap left out)
With ~64 output tokens per request the first gaps are ~1.6% of all gaps, so they alone can set
ITL p99; these two say whether a p99 comes from the hand-off or from the decode steps.
"""

from __future__ import annotations

import json
import math
import pathlib
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# (result JSON field, label): what is plotted and compared, in this order.
METRICS = (
    ("median_ttft_ms", "TTFT p50 (ms)"),
    ("p99_ttft_ms", "TTFT p99 (ms)"),
    ("p99_itl_ms", "ITL p99 (ms)"),
    ("p99_tpot_ms", "TPOT p99 (ms)"),
    ("p50_first_gap_ms", "first gap p50 (ms)"),
    ("p99_itl_after_first_ms", "ITL p99 after the first gap (ms)"),
    ("request_goodput", "goodput (req/s)"),
    ("output_throughput", "output tok/s"),
)
PLOTS = ("median_ttft_ms", "p99_ttft_ms", "p99_itl_ms", "p99_tpot_ms", "p99_itl_after_first_ms", "request_goodput")


def first_gap_split(itls: Sequence[Sequence[float]]) -> tuple[list[float], list[float]]:
    """(each request's first gap, every later gap) from per-request ITL lists, in their unit."""
    first = [float(x[0]) for x in itls if x]
    later = [float(v) for x in itls for v in x[1:]]
    return first, later


def _derived(result: dict[str, Any], metric: str) -> float | None:
    itls = result.get("itls")
    if not isinstance(itls, list) or not all(isinstance(x, list) for x in itls):
        return None
    first, later = first_gap_split(itls)
    if metric == "p50_first_gap_ms":
        return float(np.median(first)) * 1e3 if first else None
    return float(np.percentile(later, 99)) * 1e3 if later else None  # numpy's linear, as vLLM's ITL p99


DERIVED = ("p50_first_gap_ms", "p99_itl_after_first_ms")


@dataclass(frozen=True)
class Point:
    config: str
    rate: float
    result: dict[str, Any]

    @property
    def repeat(self) -> int:
        return int((self.result.get("sweep") or {}).get("repeat") or 0)

    def value(self, metric: str) -> float | None:
        if metric in DERIVED:
            return _derived(self.result, metric)
        v = self.result.get(metric)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


@dataclass(frozen=True)
class Stat:
    """One metric over the repeats of a point: median, extremes, sample std (0 for one value)."""

    median: float
    min: float
    max: float
    std: float
    n: int


def aggregate(values: Iterable[float | None]) -> Stat | None:
    """The Stat of the values present (None: that repeat has no such metric); None if none is."""
    xs = sorted(float(v) for v in values if v is not None and math.isfinite(v))
    if not xs:
        return None
    return Stat(median=statistics.median(xs), min=xs[0], max=xs[-1],
                std=statistics.stdev(xs) if len(xs) > 1 else 0.0, n=len(xs))


@dataclass(frozen=True)
class Group:
    """The repeats of one (config, rate) point, in repeat order."""

    config: str
    rate: float
    points: tuple[Point, ...]

    def stat(self, metric: str) -> Stat | None:
        return aggregate(p.value(metric) for p in self.points)

    def value(self, metric: str) -> float | None:
        st = self.stat(metric)
        return None if st is None else st.median

    def total(self, field: str) -> int | None:
        vals = [p.result.get(field) for p in self.points]
        return sum(vals) if all(isinstance(v, int) for v in vals) else None


def group_points(points: Iterable[Point]) -> list[Group]:
    """Points grouped by (config, rate): configs in first-seen order, rates ascending."""
    pts = list(points)
    by_key: dict[tuple[str, float], list[Point]] = {}
    for p in pts:
        by_key.setdefault((p.config, p.rate), []).append(p)
    return [Group(c, r, tuple(sorted(by_key[(c, r)], key=lambda p: p.repeat)))
            for c in _configs(pts) for r in _rates(pts) if (c, r) in by_key]


def rate_of(result: dict[str, Any]) -> float:
    r = result.get("request_rate")
    return math.inf if r == "inf" else float(r)


def load_points(result_dir: str | pathlib.Path) -> list[Point]:
    """Every sweep result JSON of the folder (those carrying a `sweep` record), by config then rate."""
    points = []
    for path in sorted(pathlib.Path(result_dir).glob("*.json")):
        try:
            result = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            continue
        sweep = result.get("sweep") if isinstance(result, dict) else None
        if isinstance(sweep, dict) and "config" in sweep:
            points.append(Point(sweep["config"], rate_of(result), result))
    return points


def _configs(points: Iterable[Point]) -> list[str]:
    return list(dict.fromkeys(p.config for p in points))  # first-seen order: the sweep file's order


def _rates(points: Iterable[Point]) -> list[float]:
    return sorted({p.rate for p in points})


def ratio_rows(points: Sequence[Point], baseline: str) -> list[dict[str, Any]]:
    """One row per (rate, other config): {"rate", "config", "<metric>": other / baseline or None},
    of the medians over repeats."""
    by_key = {(g.config, g.rate): g for g in group_points(points)}
    rows = []
    for rate in _rates(points):
        base = by_key.get((baseline, rate))
        for config in _configs(points):
            other = by_key.get((config, rate))
            if config == baseline or other is None or base is None:
                continue
            row: dict[str, Any] = {"rate": rate, "config": config, "baseline": baseline}
            for metric, _ in METRICS:
                a, b = other.value(metric), base.value(metric)
                row[metric] = a / b if a is not None and b not in (None, 0.0) else None
            rows.append(row)
    return rows


def _fmt_rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def format_ratio_table(rows: Sequence[dict[str, Any]]) -> str:
    if not rows:
        return "(no ratios: the baseline and another configuration need a result at the same rate)"
    head = ["rate", "config / baseline"] + [label for _, label in METRICS]
    lines = [[_fmt_rate(r["rate"]), f"{r['config']} / {r['baseline']}"]
             + ["-" if r[m] is None else f"{r[m]:.2f}x" for m, _ in METRICS] for r in rows]
    widths = [max(len(str(c)) for c in col) for col in zip(head, *lines, strict=True)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*ln) for ln in lines])


def format_stat(st: Stat | None) -> str:
    """"12.3" for one run, "12.3 [10.1-15.0]" (median [min-max]) over repeats."""
    if st is None:
        return "-"
    return f"{st.median:.1f}" if st.n == 1 else f"{st.median:.1f} [{st.min:.1f}-{st.max:.1f}]"


def format_points_table(points: Sequence[Point]) -> str:
    head = ["config", "rate", "runs", "completed", "failed"] + [label for _, label in METRICS]
    lines = [[g.config, _fmt_rate(g.rate), str(len(g.points)), str(g.total("completed")), str(g.total("failed"))]
             + [format_stat(g.stat(m)) for m, _ in METRICS] for g in group_points(points)]
    widths = [max(len(str(c)) for c in col) for col in zip(head, *lines, strict=True)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt.format(*head)] + [fmt.format(*ln) for ln in lines])


def write_plots(points: Sequence[Point], out_dir: str | pathlib.Path, title: str = "") -> list[pathlib.Path]:
    """One PNG per metric (rate on x, one line per configuration: the median over repeats, error
    bars from min to max) and sweep.png with all of them."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a benchmark machine
    import matplotlib.pyplot as plt

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    labels = dict(METRICS)
    groups = group_points(points)
    configs = _configs(points)
    # An infinite rate has no place on a numeric axis; it is plotted one step past the largest.
    finite = [r for r in _rates(points) if math.isfinite(r)]
    inf_x = (max(finite) * 2 if finite else 1.0)

    def draw(ax: Any, metric: str) -> None:
        for config in configs:
            stats = [(g.rate, st) for g in groups if g.config == config and (st := g.stat(metric)) is not None]
            if not stats:
                continue
            xs = [inf_x if math.isinf(r) else r for r, _ in stats]
            ys = [st.median for _, st in stats]
            if any(st.n > 1 for _, st in stats):
                err = [[st.median - st.min for _, st in stats], [st.max - st.median for _, st in stats]]
                ax.errorbar(xs, ys, yerr=err, marker="o", capsize=4, label=f"{config} (median, min-max)")
            else:
                ax.plot(xs, ys, marker="o", label=config)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(labels[metric])
        ax.grid(True, alpha=0.3)
        if ax.has_data():
            ax.legend()

    paths = []
    for metric in PLOTS:
        fig, ax = plt.subplots(figsize=(6, 4))
        draw(ax, metric)
        ax.set_title(f"{title} {labels[metric]}".strip())
        fig.tight_layout()
        paths.append(out / f"{metric}.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    fig, axes = plt.subplots(2, 3, figsize=(16, 8))
    for ax, metric in zip(axes.flat, PLOTS, strict=True):
        draw(ax, metric)
    fig.suptitle(title or "sweep")
    fig.tight_layout()
    paths.append(out / "sweep.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths


def write_summary(points: Sequence[Point], baseline: str, path: str | pathlib.Path) -> dict[str, Any]:
    """sweep_summary.json: the plotted numbers and the ratios, small enough to read in a diff."""
    def spread(g: Group) -> dict[str, Any]:
        return {m: None if (st := g.stat(m)) is None else {"min": st.min, "max": st.max, "std": st.std, "n": st.n}
                for m, _ in METRICS}

    summary = {
        "baseline": baseline,
        "aggregate": "median over repeats; spread: min, max, sample std",
        "points": [{"config": g.config, "rate": _fmt_rate(g.rate), "repeats": len(g.points),
                    "completed": g.total("completed"), "failed": g.total("failed"),
                    **{m: g.value(m) for m, _ in METRICS}, "spread": spread(g),
                    "files": [p.result.get("sweep", {}).get("file") for p in g.points]}
                   for g in group_points(points)],
        "ratios": [{**r, "rate": _fmt_rate(r["rate"])} for r in ratio_rows(points, baseline)],
    }
    pathlib.Path(path).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return summary
