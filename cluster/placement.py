"""Placement plan: which Ray node each worker instance should land on, checked before anything
starts. Pure (no Ray import): the launcher feeds it `ray.nodes()`.

    instance (TP ranks)  -> one placement group, STRICT_PACK: its ranks share one node
                            bundle {"CPU": tp x cpus_per_rank, "GPU": tp x gpus_per_rank, resource: amount}
    pool (N instances)   -> spread: each instance on the eligible node with fewest of the pool's
                                    instances so far (ties: most free CPU)
                            pack:   fill the first eligible node before the next

Eligible nodes are alive and carry the pool's custom resource and node label. The plan is passed
to Ray as a soft target per placement group: the resource and label stay hard constraints, the
chosen node is a preference, so Ray can still re-place an instance whose node died.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from pdcluster.cluster.config import ClusterConfig, ConfigError, PoolConfig

_EPS = 1e-9


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    address: str
    resources: Mapping[str, float]                 # totals
    available: Mapping[str, float] | None = None   # None: assume all free
    labels: Mapping[str, str] = field(default_factory=dict)
    alive: bool = True

    @classmethod
    def from_ray(cls, entry: Mapping, available: Mapping[str, float] | None = None) -> NodeInfo:
        """From one `ray.nodes()` entry."""
        return cls(str(entry["NodeID"]), str(entry.get("NodeManagerAddress", "")), dict(entry.get("Resources") or {}),
                   available, dict(entry.get("Labels") or {}), bool(entry.get("Alive", True)))

    def describe(self) -> str:
        cpus = self.resources.get("CPU", 0)
        extra = sorted(k for k in self.resources if not _builtin(k))
        return f"{self.node_id[:8]} ({self.address}, {cpus:g} CPU{', ' + ', '.join(extra) if extra else ''})"


@dataclass(frozen=True)
class InstancePlan:
    pool: str
    index: int
    node_id: str
    bundles: tuple[Mapping[str, float], ...]
    label_selector: Mapping[str, str] | None = None

    @property
    def name(self) -> str:
        return f"{self.pool}-{self.index}"


def _builtin(resource: str) -> bool:
    return resource in ("CPU", "GPU", "memory", "object_store_memory") or resource.startswith("node:")


def instance_bundles(pool: PoolConfig) -> tuple[dict[str, float], ...]:
    """One bundle for all TP ranks of an instance: a bundle never spans nodes, and the worker actor
    claims it whole, so Ray gives the instance's process exactly its tp GPUs (CUDA_VISIBLE_DEVICES)."""
    bundle: dict[str, float] = {"CPU": pool.cpus_per_rank * pool.tp}
    if pool.gpus_per_rank:
        bundle["GPU"] = pool.gpus_per_rank * pool.tp
    if pool.placement.resource:
        bundle[pool.placement.resource] = pool.placement.resource_amount
    return (bundle,)


def _total(bundles: Iterable[Mapping[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            out[k] = out.get(k, 0.0) + v
    return {k: v for k, v in out.items() if v > 0}


def _fits(need: Mapping[str, float], have: Mapping[str, float]) -> bool:
    return all(have.get(k, 0.0) + _EPS >= v for k, v in need.items())


def _eligible(pool: PoolConfig, nodes: Sequence[NodeInfo]) -> list[NodeInfo]:
    p = pool.placement
    out = [n for n in nodes if n.alive]
    if p.resource:
        out = [n for n in out if n.resources.get(p.resource, 0) > 0]
    if p.label:
        key, value = p.label
        out = [n for n in out if n.labels.get(key) == value]
    return out


def plan_placement(config: ClusterConfig, nodes: Sequence[NodeInfo]) -> list[InstancePlan]:
    """A node for every instance of every pool, or a ConfigError naming the field that cannot be
    met (resource, label, tp or instances) and what the nodes offer."""
    free = {n.node_id: dict(n.available if n.available is not None else n.resources) for n in nodes}
    plans: list[InstancePlan] = []
    for role, pool in config.pools.items():
        path = f"pools.{role}"
        eligible = _eligible(pool, nodes)
        listing = "; ".join(n.describe() for n in nodes if n.alive) or "none"
        if not eligible:
            field_name = "resource" if pool.placement.resource else "node_label"
            what = pool.placement.resource or pool.placement.node_label
            raise ConfigError(f"{path}.placement.{field_name}: no alive Ray node has {what!r} (nodes: {listing})")
        bundles = instance_bundles(pool)
        need = _total(bundles)
        if not any(_fits(need, n.resources) for n in eligible):
            biggest = max(n.resources.get("CPU", 0) for n in eligible)
            raise ConfigError(
                f"{path}.tp: an instance needs {_describe(need)} on one node (tp={pool.tp} x "
                f"{pool.cpus_per_rank:g} CPU per rank), but the largest eligible node has {biggest:g} CPU "
                f"(eligible nodes: {'; '.join(n.describe() for n in eligible)})")
        placed: dict[str, int] = {}
        selector = {pool.placement.label[0]: pool.placement.label[1]} if pool.placement.label else None
        for index in range(pool.instances):
            node = _pick(pool.placement.strategy, eligible, need, free, placed)
            if node is None:
                raise ConfigError(
                    f"{path}.instances: only {index} of {pool.instances} instances fit ({_describe(need)} each) "
                    f"on the eligible nodes' free resources (eligible: {'; '.join(n.describe() for n in eligible)})")
            for k, v in need.items():
                free[node.node_id][k] = free[node.node_id].get(k, 0.0) - v
            placed[node.node_id] = placed.get(node.node_id, 0) + 1
            plans.append(InstancePlan(role, index, node.node_id, bundles, selector))
    return plans


def _pick(strategy: str, eligible: Sequence[NodeInfo], need: Mapping[str, float],
          free: Mapping[str, Mapping[str, float]], placed: Mapping[str, int]) -> NodeInfo | None:
    fitting = [n for n in eligible if _fits(need, free[n.node_id])]
    if not fitting:
        return None
    if strategy == "spread":
        return min(fitting, key=lambda n: (placed.get(n.node_id, 0), -free[n.node_id].get("CPU", 0.0)))
    # pack: stay on a node this pool already uses while it fits, else the first in order.
    used = [n for n in fitting if placed.get(n.node_id)]
    return used[0] if used else fitting[0]


def _describe(need: Mapping[str, float]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in sorted(need.items()))
