"""The sweep file of `pdcluster bench sweep`: validated into frozen dataclasses before anything
starts, so a typo fails in milliseconds instead of after the first cluster has loaded. Errors name
the field: `configs.disaggregated.decode: must be a positive integer, got 0`.

    model: /models/llama-125m            # every cluster serves it; null: the built-in demo model
    launcher: local                      # local (`pdcluster serve`) | ray (`pdcluster up --detach`)
    output_dir: benchmarks/results/sweep # --output-dir overrides
    rates: [1, 2, 4]                     # requests per second ("inf": all at once)
    baseline: aggregated                 # the ratio table divides by it (default: the first config)
    warmup_prompts: 4                    # sent once per cluster, before its first rate (0: none)
    repeats: 3                           # runs of every (config, rate) point: median and min/max
    interleave: false                    # true: repeat i of every config in round i, clusters in turn
    workload:                            # `bench serve` flags by name (dashes or underscores)
      random_input_len: 256
      num_prompts: 32
      goodput: [ttft:2000, tpot:200]
    configs:
      aggregated: {workers: 2}
      disaggregated: {prefill: 1, decode: 1, connector: p2p, engine: {max_model_len: 1024}}
      pinned: {prefill: 1, decode: 1, pin_cpus: true}   # local only: each worker on cores of its own
      conditional: {prefill: 1, decode: 1, disagg_threshold: 256}  # short uncached prompts stay on decode
      loadaware: {prefill: 1, decode: 1, disagg_max_prefill_backlog: 512}  # decode prefills while P is behind
      loadaware1: {prefill: 1, decode: 1, disagg_max_prefill_backlog: 256,
                   disagg_max_decode_inflight: 1}    # ... only a decode worker with <= 1 request in flight
      chunked: {prefill: 1, decode: 1, disagg_max_prefill_backlog: 256,
                decode_engine: {long_prefill_token_threshold: 32}}  # one pool's engine over `engine`
    ray: {address: local, num_cpus: 4}   # --launcher ray only: `pdcluster up` fields

A configuration is translated into a `pdcluster up` cluster config and validated by its schema
(cluster/config.py), so pools, engine options, placement and connector mean the same in both.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pdcluster.cluster.config import ClusterConfig, ConfigError

LAUNCHERS = ("local", "ray")
# Flags the sweep sets itself for every point; a workload naming them would be silently overridden.
RESERVED_WORKLOAD = frozenset({"request_rate", "host", "port", "base_url", "router", "save_result", "result_dir",
                               "result_filename", "label", "metadata", "disable_tqdm"})
CONFIG_FIELDS = ("workers", "prefill", "decode", "tp", "connector", "connector_options", "engine", "prefill_engine",
                 "decode_engine", "placement", "policy", "pin_cpus", "disagg_threshold", "disagg_max_prefill_backlog",
                 "disagg_max_decode_inflight")
TOP_FIELDS = ("name", "model", "launcher", "output_dir", "rates", "baseline", "workload", "configs", "ray",
              "ready_timeout_s", "warmup_prompts", "repeats", "interleave")
DEFAULT_WARMUP_PROMPTS = 4
RAY_FIELDS = ("address", "num_cpus", "namespace", "dashboard", "worker_host")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # becomes part of file names


class SweepError(ValueError):
    """A sweep-file mistake; the message starts with the field's dotted path."""


@dataclass(frozen=True)
class ClusterEntry:
    name: str
    spec: dict[str, Any]          # the sweep file's entry, recorded in every result JSON
    cluster: dict[str, Any]       # the same as a `pdcluster up` config (validated by its schema)

    @property
    def pinned(self) -> bool:
        """`pin_cpus: true`: `serve --pin-cpus`, every worker on cores of its own."""
        return bool(self.spec.get("pin_cpus"))

    @property
    def disaggregated(self) -> bool:
        return "both" not in self.cluster["pools"]


@dataclass(frozen=True)
class SweepConfig:
    configs: tuple[ClusterEntry, ...]
    rates: tuple[float, ...]
    workload: dict[str, Any]      # bench serve dests -> values already converted by their flag's type
    model: str | None = None
    name: str = "sweep"
    launcher: str = "local"
    output_dir: str | None = None
    baseline: str = ""
    ray: dict[str, Any] = field(default_factory=dict)
    ready_timeout_s: float = 600.0
    warmup_prompts: int = DEFAULT_WARMUP_PROMPTS  # per cluster, once, before its first rate
    repeats: int = 1              # runs per (config, rate); repeat i uses workload seed + i
    # False: each configuration's repeats back to back on one cluster. True: rounds, repeat i of every
    # configuration in round i (a fresh cluster each, the order rotated per round), so a shared
    # machine's slow minutes fall on every configuration alike rather than on whichever ran then.
    interleave: bool = False


def serve_parser() -> argparse.ArgumentParser:
    from pdcluster.cluster.bench.cli import add_serve_arguments

    p = argparse.ArgumentParser(prog="pdcluster bench serve", add_help=False)
    add_serve_arguments(p)
    return p


def _mapping(raw: Any, path: str, known: tuple[str, ...]) -> dict[str, Any]:
    where = path or "sweep file"
    if not isinstance(raw, Mapping):
        raise SweepError(f"{where}: must be a mapping, got {type(raw).__name__}")
    unknown = [k for k in raw if k not in known]
    if unknown:
        prefix = f"{path}." if path else ""
        raise SweepError(f"{prefix}{unknown[0]}: unknown field; known: {', '.join(known)}")
    return dict(raw)


def _positive_int(v: Any, path: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise SweepError(f"{path}: must be a positive integer, got {v!r}")
    return v


def parse_rate(v: Any, path: str) -> float:
    if isinstance(v, str) and v.strip().lower() in ("inf", "infinity"):
        return math.inf
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or math.isnan(v):
        raise SweepError(f"{path}: must be a positive number of requests per second or \"inf\", got {v!r}")
    return float(v)


def parse_workload(raw: Any) -> dict[str, Any]:
    """bench serve options by dest, each converted and checked by its own flag's type and choices."""
    actions = {a.dest: a for a in serve_parser()._actions if a.option_strings}
    known = tuple(sorted(d for d in actions if d not in RESERVED_WORKLOAD))
    out: dict[str, Any] = {}
    if raw is not None and not isinstance(raw, Mapping):
        raise SweepError(f"workload: must be a mapping of `bench serve` flags, got {type(raw).__name__}")
    for key, value in (raw or {}).items():
        dest, path = key.replace("-", "_"), f"workload.{key}"
        if dest in RESERVED_WORKLOAD:
            raise SweepError(f"{path}: set by the sweep itself (rates, the cluster's endpoints, the output "
                             "folder); remove it")
        action = actions.get(dest)
        if action is None:
            raise SweepError(f"{path}: not a `bench serve` flag; known: {', '.join(known)}")
        out[dest] = _convert(action, value, path)
    return out


def _convert(action: argparse.Action, value: Any, path: str) -> Any:
    if isinstance(action, argparse._StoreTrueAction):
        if not isinstance(value, bool):
            raise SweepError(f"{path}: must be true or false, got {value!r}")
        return value
    if value is None:
        return None
    if action.nargs in ("+", "*"):
        items = value if isinstance(value, list) else str(value).split()
        return [_convert_one(action, item, f"{path}[{i}]") for i, item in enumerate(items)]
    if isinstance(value, (list, dict)):
        raise SweepError(f"{path}: must be a single value, got {value!r}")
    return _convert_one(action, value, path)


def _convert_one(action: argparse.Action, value: Any, path: str) -> Any:
    if isinstance(value, bool) and action.type in (int, float):
        raise SweepError(f"{path}: must be a number, got {value!r}")
    convert = action.type or str
    try:
        out = convert(str(value)) if not isinstance(value, (int, float)) or convert is str else convert(value)
    except (TypeError, ValueError):
        kind = getattr(convert, "__name__", "value")
        raise SweepError(f"{path}: must be {'an' if kind == 'int' else 'a'} {kind}, got {value!r}") from None
    if action.choices is not None and out not in action.choices:
        raise SweepError(f"{path}: must be one of {', '.join(map(str, action.choices))}, got {value!r}")
    return out


def cluster_dict(name: str, raw: Any, model: str | None) -> dict[str, Any]:
    """A sweep entry as a `pdcluster up` cluster config (before validation)."""
    path = f"configs.{name}"
    d = _mapping(raw, path, CONFIG_FIELDS)
    aggregated = d.get("workers") is not None
    if aggregated and (d.get("prefill") is not None or d.get("decode") is not None):
        raise SweepError(f"{path}: give `workers` (aggregated) or `prefill` and `decode` (disaggregated), not both")
    if not aggregated and (d.get("prefill") is None or d.get("decode") is None):
        raise SweepError(f"{path}: needs `workers: N` (aggregated) or `prefill: N` and `decode: M` (disaggregated)")
    placement = _mapping(d.get("placement") or {}, f"{path}.placement", ("both",) if aggregated
                         else ("prefill", "decode"))
    pools: dict[str, Any] = {}
    for key in ("prefill_engine", "decode_engine"):
        if aggregated and d.get(key) is not None:
            raise SweepError(f"{path}.{key}: needs prefill and decode pools (aggregated workers take `engine`)")
    for role, key in ((("both", "workers"),) if aggregated else (("prefill", "prefill"), ("decode", "decode"))):
        pool: dict[str, Any] = {"instances": _positive_int(d[key], f"{path}.{key}")}
        if d.get("tp") is not None:
            pool["tp"] = _positive_int(d["tp"], f"{path}.tp")
        shared, own = d.get("engine") or {}, d.get(f"{role}_engine") or {}
        for name, value in (("engine", shared), (f"{role}_engine", own)):
            if not isinstance(value, Mapping):
                raise SweepError(f"{path}.{name}: must map engine options to values, got {value!r}")
        engine = {**shared, **own}  # the pool's own options over the shared ones
        if engine:
            pool["engine"] = engine
        if placement.get(role):
            pool["placement"] = placement[role]
        pools[role] = pool
    out: dict[str, Any] = {"pools": pools}
    if model is not None:
        out["model"] = model
    if d.get("connector") is not None or not aggregated:
        out["connector"] = {"name": d.get("connector") or "p2p", "options": d.get("connector_options") or {}}
    router: dict[str, Any] = {}
    if d.get("policy") is not None:
        router["policy"] = d["policy"]
    for key, router_key in (("disagg_threshold", "disagg_min_uncached_tokens"),
                            ("disagg_max_prefill_backlog", "disagg_max_prefill_backlog_tokens"),
                            ("disagg_max_decode_inflight", "disagg_max_decode_inflight")):
        if d.get(key) is not None:
            if aggregated:
                raise SweepError(f"{path}.{key}: needs prefill and decode pools")
            router[router_key] = d[key]  # checked by the cluster schema
    if router:
        out["router"] = router
    if not isinstance(d.get("pin_cpus", False), bool):
        raise SweepError(f"{path}.pin_cpus: must be true or false, got {d['pin_cpus']!r}")
    return out


def parse_entry(name: Any, raw: Any, model: str | None) -> ClusterEntry:
    if not isinstance(name, str) or not _NAME.match(name):
        raise SweepError(f"configs.{name}: a configuration name is letters, digits, '_', '-', '.' (it names files)")
    cluster = cluster_dict(name, raw, model)
    try:
        ClusterConfig.from_dict(cluster)
    except ConfigError as e:
        # The cluster schema names `pools.decode.engine...`; say where that is in the sweep file.
        raise SweepError(f"configs.{name}: {e}") from None
    return ClusterEntry(name=name, spec=dict(raw), cluster=cluster)


def parse_sweep(raw: Any) -> SweepConfig:
    d = _mapping(raw, "", TOP_FIELDS)
    model = d.get("model")
    if model is not None and not isinstance(model, str):
        raise SweepError(f"model: must be a path, got {model!r}")
    configs_raw = d.get("configs")
    if not isinstance(configs_raw, Mapping) or not configs_raw:
        raise SweepError("configs: must map names to cluster configurations, e.g. {aggregated: {workers: 2}}")
    configs = tuple(parse_entry(n, c, model) for n, c in configs_raw.items())
    rates_raw = d.get("rates")
    if isinstance(rates_raw, (int, float, str)) and not isinstance(rates_raw, bool):
        rates_raw = [rates_raw]
    if not isinstance(rates_raw, list) or not rates_raw:
        raise SweepError(f"rates: must be a non-empty list of requests per second, got {rates_raw!r}")
    rates = tuple(parse_rate(r, f"rates[{i}]") for i, r in enumerate(rates_raw))
    if len(set(rates)) != len(rates):
        raise SweepError(f"rates: repeated rate in {rates_raw}")
    out: dict[str, Any] = {"configs": configs, "rates": rates, "workload": parse_workload(d.get("workload")),
                           "model": model}
    names = [c.name for c in configs]
    baseline = d.get("baseline", names[0])
    if baseline not in names:
        raise SweepError(f"baseline: must name one of the configs ({', '.join(names)}), got {baseline!r}")
    out["baseline"] = baseline
    if d.get("launcher") is not None:
        if d["launcher"] not in LAUNCHERS:
            raise SweepError(f"launcher: must be one of {', '.join(LAUNCHERS)}, got {d['launcher']!r}")
        out["launcher"] = d["launcher"]
    pinned = [c.name for c in configs if c.pinned]
    if pinned and out.get("launcher", "local") != "local":
        raise SweepError(f"configs.{pinned[0]}.pin_cpus: only the local launcher pins workers to cores "
                         "(on Ray, give the pools placement and num_cpus)")
    for key in ("name", "output_dir"):
        if d.get(key) is not None:
            if not isinstance(d[key], str) or not d[key]:
                raise SweepError(f"{key}: must be a non-empty string, got {d[key]!r}")
            out[key] = d[key]
    if d.get("ready_timeout_s") is not None:
        t = d["ready_timeout_s"]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise SweepError(f"ready_timeout_s: must be a positive number of seconds, got {t!r}")
        out["ready_timeout_s"] = float(t)
    if d.get("warmup_prompts") is not None:
        w = d["warmup_prompts"]
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise SweepError(f"warmup_prompts: must be a number of requests >= 0 (0: no warm-up), got {w!r}")
        out["warmup_prompts"] = w
    if d.get("repeats") is not None:
        out["repeats"] = _positive_int(d["repeats"], "repeats")
    if d.get("interleave") is not None:
        if not isinstance(d["interleave"], bool):
            raise SweepError(f"interleave: must be true or false, got {d['interleave']!r}")
        out["interleave"] = d["interleave"]
    out["ray"] = _mapping(d.get("ray") or {}, "ray", RAY_FIELDS)
    return SweepConfig(**out)


def load_sweep(path: str) -> SweepConfig:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except OSError as e:
        raise SweepError(f"{path}: cannot read the sweep file: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise SweepError(f"{path}: not valid YAML: {e}") from None
    return parse_sweep(raw if raw is not None else {})
