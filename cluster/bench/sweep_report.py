"""What a sweep leaves behind, computed from its result JSONs alone (so a sweep can be re-plotted
or compared later without rerunning it): the points, the PNG plots, and the ratio table of every
configuration against the baseline at each rate.

Ratios are other / baseline: below 1 is better for latencies, above 1 better for goodput and
throughput.
"""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

# (result JSON field, label): what is plotted and compared, in this order.
METRICS = (
    ("median_ttft_ms", "TTFT p50 (ms)"),
    ("p99_ttft_ms", "TTFT p99 (ms)"),
    ("p99_itl_ms", "ITL p99 (ms)"),
    ("request_goodput", "goodput (req/s)"),
    ("output_throughput", "output tok/s"),
)
PLOTS = ("median_ttft_ms", "p99_ttft_ms", "p99_itl_ms", "request_goodput")


@dataclass(frozen=True)
class Point:
    config: str
    rate: float
    result: dict[str, Any]

    def value(self, metric: str) -> float | None:
        v = self.result.get(metric)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


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
    """One row per (rate, other config): {"rate", "config", "<metric>": other / baseline or None}."""
    by_key = {(p.config, p.rate): p for p in points}
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


def format_points_table(points: Sequence[Point]) -> str:
    head = ["config", "rate", "completed", "failed"] + [label for _, label in METRICS]
    lines = [[p.config, _fmt_rate(p.rate), str(p.result.get("completed")), str(p.result.get("failed"))]
             + ["-" if p.value(m) is None else f"{p.value(m):.1f}" for m, _ in METRICS] for p in points]
    widths = [max(len(str(c)) for c in col) for col in zip(head, *lines, strict=True)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt.format(*head)] + [fmt.format(*ln) for ln in lines])


def write_plots(points: Sequence[Point], out_dir: str | pathlib.Path, title: str = "") -> list[pathlib.Path]:
    """One PNG per metric (rate on x, one line per configuration) and sweep.png with all four."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a benchmark machine
    import matplotlib.pyplot as plt

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    labels = dict(METRICS)
    configs = _configs(points)
    # An infinite rate has no place on a numeric axis; it is plotted one step past the largest.
    finite = [r for r in _rates(points) if math.isfinite(r)]
    inf_x = (max(finite) * 2 if finite else 1.0)

    def draw(ax: Any, metric: str) -> None:
        for config in configs:
            pts = sorted((p for p in points if p.config == config and p.value(metric) is not None),
                         key=lambda p: p.rate)
            if pts:
                ax.plot([inf_x if math.isinf(p.rate) else p.rate for p in pts], [p.value(metric) for p in pts],
                        marker="o", label=config)
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
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
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
    summary = {
        "baseline": baseline,
        "points": [{"config": p.config, "rate": _fmt_rate(p.rate), "completed": p.result.get("completed"),
                    "failed": p.result.get("failed"), **{m: p.value(m) for m, _ in METRICS},
                    "file": p.result.get("sweep", {}).get("file")} for p in points],
        "ratios": [{**r, "rate": _fmt_rate(r["rate"])} for r in ratio_rows(points, baseline)],
    }
    pathlib.Path(path).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return summary
