"""The cluster config of `pdcluster up`: one YAML file (or the same fields as flags), validated
into frozen dataclasses before anything starts. Errors name the field: `pools.decode.tp: must be a
positive integer, got 0`; unknown fields are refused with the list of known ones.

    model: /models/qwen3-0.6b          # default: the built-in demo model
    namespace: pdcluster               # Ray namespace of the actors (status/down find them there)
    router: {host: 127.0.0.1, grpc_port: 50051, http_port: 8000, policy: prefix_aware}
    pools:                             # `both` alone (aggregated) or `prefill` + `decode`; either
                                       # with an `encode` pool (multimodal: encoder-only instances)
      prefill:
        instances: 2
        tp: 1
        engine: {max_model_len: 4096}  # serve-worker flags by name (--max-model-len 4096)
        placement: {strategy: spread, resource: prefill_node}   # or node_label: "pool=prefill"
      decode: {instances: 1, tp: 2, placement: {strategy: pack, resource: decode_node}}
    connector: {name: p2p, options: {}}
    ec_connector: {name: p2p_ec}       # encoder-cache sharing; default: p2p_ec with an encode pool
    key_dir: null                      # null: fresh keys in a private folder
    log_dir: null                      # null: worker logs go to Ray's log folder

Pure: imports only the standard library and the (stdlib-only) serve-worker/serve argument
parsers, whose flags are the source of truth for engine options and policy names.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from pdcluster.cluster.worker_flags import RESERVED_WORKER_FLAGS, worker_flag_actions

ROLES = ("prefill", "decode", "both", "encode")
EC_CONNECTORS = ("p2p_ec",)  # built-in EC connector names (a dotted path names a plugin)
STRATEGIES = ("spread", "pack")
_FALLBACK_CONNECTORS = ("p2p",)  # when the connector registry cannot be imported
# The router's rules for when to disaggregate (router/disagg_rule.py): non-negative, and only
# meaningful with prefill and decode pools.
_DISAGG_RULES = ("disagg_min_uncached_tokens", "disagg_max_prefill_backlog_tokens")


class ConfigError(ValueError):
    """A config mistake; the message starts with the field's dotted path."""


@dataclass(frozen=True)
class Placement:
    strategy: str = "pack"               # how a pool's instances spread over eligible nodes
    resource: str | None = None          # custom Ray resource marking eligible nodes
    resource_amount: float = 0.01        # taken per instance: a node with {res: 1} hosts up to 100
    node_label: str | None = None        # "key=value" Ray node label marking eligible nodes

    @property
    def label(self) -> tuple[str, str] | None:
        if self.node_label is None:
            return None
        key, _, value = self.node_label.partition("=")
        return key, value


@dataclass(frozen=True)
class PoolConfig:
    role: str
    instances: int = 1
    tp: int = 1
    cpus_per_rank: float = 1.0
    gpus_per_rank: float = 0.0
    max_restarts: int = 3                # Ray restarts a crashed worker actor this many times
    engine: Mapping[str, Any] = field(default_factory=dict)
    placement: Placement = field(default_factory=Placement)


@dataclass(frozen=True)
class RouterSection:
    host: str = "127.0.0.1"
    grpc_port: int = 50051
    http_port: int | None = 8000         # null or -1: no HTTP frontend
    policy: str = "prefix_aware"
    max_inflight: int = 1024
    max_retries: int = 2
    max_migrations: int = 2              # resumes of a request on another worker after its first token
    # Conditional disaggregation: prompts whose uncached part is at most this many tokens are
    # served by a decode worker alone (0: always disaggregate when both pools exist).
    disagg_min_uncached_tokens: int = 0
    # Load-aware disaggregation: while the least busy prefill worker has more than this many prompt
    # tokens queued, a decode worker that would be done with the prompt before the prefill worker
    # could start it prefills it itself (0: never).
    disagg_max_prefill_backlog_tokens: int = 0
    # ... counting only decode workers with at most this many requests in flight (None: any).
    disagg_max_decode_inflight: int | None = None
    stall_timeout_s: float = 0.0         # silence after the first token that counts as a failed worker
    health_interval_s: float = 1.0
    eject_after_failures: int = 1        # a restarted actor is a new port: one failed check is enough
    request_timeout_s: float = 600.0
    served_model_name: str | tuple[str, ...] | None = None  # one name or several (all listed)
    chat_template: str | None = None     # the template text (the YAML may name a file: read at load)
    reasoning_parser: str | None = None  # router/reasoning.py's names
    tool_call_parser: str = "hermes"     # router/tool_parsers.py's names, or a plugin's module:function
    generation_config: str = "auto"      # auto | vllm | a folder (pdcluster/generation_defaults.py)


@dataclass(frozen=True)
class ConnectorConfig:
    name: str
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ClusterConfig:
    pools: Mapping[str, PoolConfig]
    model: str | None = None
    namespace: str = "pdcluster"
    router: RouterSection = field(default_factory=RouterSection)
    connector: ConnectorConfig | None = None
    # Encoder-cache connector of every instance (None: p2p_ec when there is an encode pool, else none).
    ec_connector: ConnectorConfig | None = None
    key_dir: str | None = None
    log_dir: str | None = None
    ready_timeout_s: float = 300.0
    worker_host: str = "auto"            # "auto": loopback on a local one-node cluster, else node IP
    num_cpus: int | None = None          # CPUs of a local cluster that `up` starts (None: detect)
    dashboard: bool = True               # Ray dashboard on that local head (~1 GiB RSS; `status`
                                         # reads restart counts through it)

    @property
    def disaggregated(self) -> bool:
        return "both" not in self.pools

    @property
    def num_instances(self) -> int:
        return sum(p.instances for p in self.pools.values())

    @classmethod
    def from_dict(cls, raw: Any, *, connector_names: Callable[[], list[str]] | None = None) -> ClusterConfig:
        return _parse_cluster(raw, connector_names or known_connector_names)


# -- loading and overrides ----------------------------------------------------------------------
def load_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    import yaml

    with open(path, encoding="utf-8") as f:
        raw = yaml.safe_load(f)  # safe_load: a config file never constructs Python objects
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(raw).__name__}")
    return raw


def known_connector_names() -> list[str]:
    try:
        from pdcluster.connectors.registry import available_connectors
    except ImportError:
        return list(_FALLBACK_CONNECTORS)
    return list(available_connectors())


# -- validation ---------------------------------------------------------------------------------
def _mapping(raw: Any, path: str, known: list[str]) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path}: must be a mapping, got {type(raw).__name__}")
    unknown = sorted(str(k) for k in raw if k not in known)
    if unknown:
        raise ConfigError(f"{path or 'config'}: unknown field(s) {unknown}; known fields: {sorted(known)}")
    return dict(raw)


def _names(cls: type) -> list[str]:
    return [f.name for f in fields(cls)]


def _int(v: Any, path: str, *, minimum: int = 1, maximum: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum or (maximum is not None and v > maximum):
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        what = f"an integer in [{minimum}, {maximum}]" if maximum is not None else what
        raise ConfigError(f"{path}: must be {what}, got {v!r}")
    return v


def _num(v: Any, path: str, *, positive: bool = True) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (v <= 0 if positive else v < 0):
        raise ConfigError(f"{path}: must be a {'positive' if positive else 'non-negative'} number, got {v!r}")
    return float(v)


def _str(v: Any, path: str) -> str:
    if not isinstance(v, str) or not v:
        raise ConfigError(f"{path}: must be a non-empty string, got {v!r}")
    return v


def _choice(v: Any, path: str, choices: tuple[str, ...] | list[str]) -> str:
    if v not in choices:
        raise ConfigError(f"{path}: must be one of {list(choices)}, got {v!r}")
    return v


def _parse_cluster(raw: Any, connector_names: Callable[[], list[str]]) -> ClusterConfig:
    d = _mapping(raw, "", _names(ClusterConfig))
    pools_raw = _mapping(d["pools"] if d.get("pools") is not None else {"both": {}}, "pools", list(ROLES))
    if set(pools_raw) - {"encode"} not in ({"both"}, {"prefill", "decode"}):
        raise ConfigError(f"pools: give either one `both` pool (aggregated) or `prefill` and `decode` pools "
                          f"(and optionally an `encode` pool), got {sorted(pools_raw)}")
    actions = worker_flag_actions()
    pools = {role: _parse_pool(role, pools_raw[role], actions) for role in ROLES if role in pools_raw}
    connector = None
    if d.get("connector") is not None:
        connector = _parse_connector(d["connector"], connector_names)
    elif "both" not in pools:
        raise ConfigError(f"connector: prefill and decode pools need a KV connector (e.g. name: "
                          f"{connector_names()[0] if connector_names() else 'p2p'})")
    ec_connector = _parse_ec_connector(d.get("ec_connector"), "encode" in pools)
    router = _parse_router(d.get("router"))
    if "both" in pools:  # an aggregated cluster never disaggregates: a rule for it would do nothing
        for key in _DISAGG_RULES:
            if getattr(router, key):
                raise ConfigError(f"router.{key}: needs prefill and decode pools, got a `both` pool")
    out: dict[str, Any] = {"pools": pools, "connector": connector, "ec_connector": ec_connector, "router": router}
    for key in ("model", "key_dir", "log_dir"):
        if d.get(key) is not None:
            out[key] = _str(d[key], key)
    if d.get("namespace") is not None:
        out["namespace"] = _str(d["namespace"], "namespace")
    if d.get("ready_timeout_s") is not None:
        out["ready_timeout_s"] = _num(d["ready_timeout_s"], "ready_timeout_s")
    if d.get("worker_host") is not None:
        out["worker_host"] = _str(d["worker_host"], "worker_host")
    if d.get("num_cpus") is not None:
        out["num_cpus"] = _int(d["num_cpus"], "num_cpus")
    if d.get("dashboard") is not None:
        if not isinstance(d["dashboard"], bool):
            raise ConfigError(f"dashboard: must be true or false, got {d['dashboard']!r}")
        out["dashboard"] = d["dashboard"]
    return ClusterConfig(**out)


def _parse_pool(role: str, raw: Any, actions: Mapping[str, argparse.Action]) -> PoolConfig:
    path = f"pools.{role}"
    d = _mapping(raw, path, [n for n in _names(PoolConfig) if n != "role"])
    out: dict[str, Any] = {"role": role}
    for key in ("instances", "tp"):
        if key in d:
            out[key] = _int(d[key], f"{path}.{key}")
    if "max_restarts" in d:
        out["max_restarts"] = _int(d["max_restarts"], f"{path}.max_restarts", minimum=-1)
    if "cpus_per_rank" in d:
        out["cpus_per_rank"] = _num(d["cpus_per_rank"], f"{path}.cpus_per_rank", positive=False)
    if "gpus_per_rank" in d:
        out["gpus_per_rank"] = _num(d["gpus_per_rank"], f"{path}.gpus_per_rank", positive=False)
    out["engine"] = _parse_engine(d.get("engine"), f"{path}.engine", actions)
    out["placement"] = _parse_placement(d.get("placement"), f"{path}.placement")
    return PoolConfig(**out)


def _parse_engine(raw: Any, path: str, actions: Mapping[str, argparse.Action]) -> dict[str, Any]:
    known = sorted(n for n in actions if n not in RESERVED_WORKER_FLAGS)
    d = _mapping(raw, path, known)
    for name, value in d.items():
        a, p = actions[name], f"{path}.{name}"
        if isinstance(a, argparse._StoreTrueAction):
            if not isinstance(value, bool):
                raise ConfigError(f"{p}: must be true or false, got {value!r}")
        elif value is not None and a.type in (int, float):
            if isinstance(value, bool) or not isinstance(value, (int, float) if a.type is float else int):
                raise ConfigError(f"{p}: must be {'a number' if a.type is float else 'an integer'}, got {value!r}")
        elif value is not None and not isinstance(value, (str, int, float)):
            raise ConfigError(f"{p}: must be a scalar, got {type(value).__name__}")
        if a.choices is not None and value not in a.choices:
            raise ConfigError(f"{p}: must be one of {list(a.choices)}, got {value!r}")
    return d


def _parse_placement(raw: Any, path: str) -> Placement:
    d = _mapping(raw, path, _names(Placement))
    out: dict[str, Any] = {}
    if "strategy" in d:
        out["strategy"] = _choice(d["strategy"], f"{path}.strategy", STRATEGIES)
    if d.get("resource") is not None:
        out["resource"] = _str(d["resource"], f"{path}.resource")
    if "resource_amount" in d:
        out["resource_amount"] = _num(d["resource_amount"], f"{path}.resource_amount")
    if d.get("node_label") is not None:
        label = _str(d["node_label"], f"{path}.node_label")
        if label.count("=") != 1 or label.startswith("="):
            raise ConfigError(f"{path}.node_label: must look like 'key=value', got {label!r}")
        out["node_label"] = label
    return Placement(**out)


def _parse_router(raw: Any) -> RouterSection:
    from pdcluster.cluster.router_cmd import POLICIES  # stdlib-only module: the router's policy names

    d = _mapping(raw, "router", _names(RouterSection))
    out: dict[str, Any] = {}
    if "host" in d:
        out["host"] = _str(d["host"], "router.host")
    if "grpc_port" in d:
        out["grpc_port"] = _int(d["grpc_port"], "router.grpc_port", minimum=0, maximum=65535)
    if "http_port" in d:
        port = d["http_port"]
        out["http_port"] = None if port in (None, -1) else _int(port, "router.http_port", minimum=0, maximum=65535)
    if "policy" in d:
        out["policy"] = _choice(d["policy"], "router.policy", POLICIES)
    for key in ("max_inflight", "eject_after_failures"):
        if key in d:
            out[key] = _int(d[key], f"router.{key}")
    for key in ("max_retries", "max_migrations", *_DISAGG_RULES):
        if key in d:
            out[key] = _int(d[key], f"router.{key}", minimum=0)
    if d.get("disagg_max_decode_inflight") is not None:
        out["disagg_max_decode_inflight"] = _int(d["disagg_max_decode_inflight"], "router.disagg_max_decode_inflight",
                                                 minimum=0)
        if not out.get("disagg_max_prefill_backlog_tokens"):
            raise ConfigError("router.disagg_max_decode_inflight: limits load-aware disaggregation, so it needs "
                              "router.disagg_max_prefill_backlog_tokens > 0")
    for key in ("health_interval_s", "request_timeout_s"):
        if key in d:
            out[key] = _num(d[key], f"router.{key}")
    if "stall_timeout_s" in d:
        out["stall_timeout_s"] = _num(d["stall_timeout_s"], "router.stall_timeout_s", positive=False)
    if d.get("served_model_name") is not None:
        names = d["served_model_name"]
        if isinstance(names, list) and names:
            out["served_model_name"] = tuple(_str(n, "router.served_model_name[]") for n in names)
        else:
            out["served_model_name"] = _str(names, "router.served_model_name")
    if d.get("reasoning_parser") is not None:
        from pdcluster.router.reasoning import REASONING_PARSERS

        out["reasoning_parser"] = _str(d["reasoning_parser"], "router.reasoning_parser")
        if out["reasoning_parser"] not in REASONING_PARSERS:
            raise ConfigError(f"router.reasoning_parser: {out['reasoning_parser']!r} is not one of "
                              f"{sorted(REASONING_PARSERS)}")
    if d.get("tool_call_parser") is not None:
        from pdcluster.cluster.router_cmd import check_tool_call_parser

        out["tool_call_parser"] = _str(d["tool_call_parser"], "router.tool_call_parser")
        try:
            check_tool_call_parser(out["tool_call_parser"])
        except ValueError as e:
            raise ConfigError(f"router.tool_call_parser: {e}") from None
    if d.get("generation_config") is not None:
        out["generation_config"] = _str(d["generation_config"], "router.generation_config")
    if d.get("chat_template") is not None:
        from pdcluster.engine.tokenizer import load_chat_template

        try:
            out["chat_template"] = load_chat_template(_str(d["chat_template"], "router.chat_template"))
        except ValueError as e:
            raise ConfigError(f"router.chat_template: {e}") from None
    return RouterSection(**out)


def _parse_ec_connector(raw: Any, has_encoders: bool) -> ConnectorConfig | None:
    """ec_connector: a name, {name, options}, or null/"none"; default p2p_ec with an encode pool."""
    if raw is None or raw == "none":
        if raw == "none" and has_encoders:
            raise ConfigError("ec_connector: an encode pool needs an EC connector (e.g. name: p2p_ec), not none")
        return ConnectorConfig("p2p_ec") if has_encoders and raw is None else None
    if isinstance(raw, str):
        raw = {"name": raw}
    d = _mapping(raw, "ec_connector", _names(ConnectorConfig))
    name = _str(d.get("name"), "ec_connector.name")
    if ":" not in name and name not in EC_CONNECTORS:
        raise ConfigError(f"ec_connector.name: unknown EC connector {name!r}; available: {list(EC_CONNECTORS)}, "
                          f"or a dotted path 'package.module:Class'")
    options = d.get("options") or {}
    if not isinstance(options, Mapping):
        raise ConfigError(f"ec_connector.options: must be a mapping, got {type(options).__name__}")
    return ConnectorConfig(name, dict(options))


def _parse_connector(raw: Any, connector_names: Callable[[], list[str]]) -> ConnectorConfig:
    if isinstance(raw, str):
        raw = {"name": raw}
    d = _mapping(raw, "connector", _names(ConnectorConfig))
    name = _str(d.get("name"), "connector.name")
    # A dotted path is resolved by the workers (their nodes have the plugin installed).
    if ":" not in name:
        known = connector_names()
        if name not in known:
            raise ConfigError(f"connector.name: unknown KV connector {name!r}; available: {known}, or a "
                              f"dotted path 'package.module:Class'")
    options = d.get("options") or {}
    if not isinstance(options, Mapping):
        raise ConfigError(f"connector.options: must be a mapping, got {type(options).__name__}")
    return ConnectorConfig(name, dict(options))
