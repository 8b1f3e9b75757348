"""EngineConfig <-> plain dict, so rank 0 can hand its *resolved* config to the other ranks.

Ranks must not resolve EngineArgs themselves: "auto" choices (the number of KV blocks from free
memory, the compute dtype) could come out differently per process, and every rank must build
exactly the same cache and model. The dict is msgpack-safe; tuples become lists on the way and
are restored here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pdcluster.config import (
    CacheConfig,
    EngineConfig,
    MultiModalConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from pdcluster.models.hf_config import ModelConfig


def engine_config_to_dict(config: EngineConfig) -> dict[str, Any]:
    d = dataclasses.asdict(config)
    rope = d["model"]["rope_scaling"]
    d["model"]["rope_scaling"] = [list(kv) for kv in rope] if rope is not None else None
    d["model"]["eos_token_ids"] = list(d["model"]["eos_token_ids"])
    return d


def engine_config_from_dict(d: dict[str, Any]) -> EngineConfig:
    m = dict(d["model"])
    if m.get("rope_scaling") is not None:
        m["rope_scaling"] = tuple((str(k), v) for k, v in m["rope_scaling"])
    m["eos_token_ids"] = tuple(m.get("eos_token_ids") or ())
    _known(ModelConfig, m)
    rest = {k: v for k, v in d.items() if k not in ("model", "cache", "scheduler", "parallel", "mm", "speculative")}
    _known(EngineConfig, rest)
    return EngineConfig(
        model=ModelConfig(**m),
        cache=CacheConfig(**_known(CacheConfig, d["cache"])),
        scheduler=SchedulerConfig(**_known(SchedulerConfig, d["scheduler"])),
        parallel=ParallelConfig(**_known(ParallelConfig, d["parallel"])),
        mm=MultiModalConfig(**_known(MultiModalConfig, d.get("mm") or {})),
        speculative=SpeculativeConfig.parse(d.get("speculative")),
        **rest,
    )


def _known(cls: type, d: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown field(s) {unknown}")
    return d
