"""Routing policies: which worker of a pool serves a request.

One interface, `RoutingPolicy.pick(request, workers, stats) -> WorkerView | None`, pure: no I/O,
no clocks, no global state (a policy instance may keep its own counter or seeded RNG). The
router filters the pool (role, circuit breaker) before calling pick; pick itself skips
unhealthy workers and returns None when nobody can serve. A policy that routes by cached
prefix also answers `block_hashes(request, block_size)` and `prefix_match(request, workers)`;
with images (`RouteRequest.mm_offset`) the chain stops before the first block covering one;
the router asks every policy these (the defaults say "not a prefix policy") and passes the
workers' block size in, so it never needs to know a policy's class or set its attributes.
Policies are found by name in `ROUTING_POLICIES`, a closed `Registry` (pdcluster/registry.py).

Load of a worker (`WorkerStats.queue_len`): the larger of the router's own in-flight count
(fresh, but blind to other routers) and the worker's running + waiting (counts everybody,
but as old as the last stats poll).
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

from pdcluster.registry import Registry, subclass_of

from .prefix_index import PrefixIndex


@dataclass(frozen=True)
class RouteRequest:
    request_id: str
    prompt_token_ids: Sequence[int] = ()
    # Chained block hashes of the prompt; None = compute from prompt_token_ids when a policy
    # needs them (prefix_aware with a block_size).
    block_hashes: Sequence[bytes] | None = None
    # Index of the first image placeholder token (None: no images). Workers key every block from
    # the one covering it on by the image's mm_hash (a hash of preprocessed pixels the router
    # never computes), so a prefix policy hashes only the full blocks before it: it never counts
    # a same-text/other-image block as cached.
    mm_offset: int | None = None
    # The request's sampling_params.cache_salt: the workers key the first block by it, so the
    # router must too, or a salted prompt never matches its own cached blocks.
    cache_salt: str | None = None


@dataclass(frozen=True)
class WorkerView:
    worker_id: str
    address: str
    role: str = "both"  # "prefill" | "decode" | "both"
    healthy: bool = True


@dataclass(frozen=True)
class WorkerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks in use, [0, 1]
    num_inflight: int = 0  # requests this router has sent and not seen finish

    @property
    def queue_len(self) -> int:
        return max(self.num_inflight, self.num_running + self.num_waiting)


_IDLE = WorkerStats()
StatsMap = Mapping[str, WorkerStats]


def _healthy(workers: Sequence[WorkerView]) -> list[WorkerView]:
    return [w for w in workers if w.healthy]


def _load_key(stats: StatsMap, w: WorkerView) -> tuple[int, float]:
    s = stats.get(w.worker_id, _IDLE)
    return (s.queue_len, s.kv_usage)


class RoutingPolicy(ABC):
    name: ClassVar[str]

    @abstractmethod
    def pick(self, request: RouteRequest, workers: Sequence[WorkerView], stats: StatsMap) -> WorkerView | None:
        """The worker to serve request, or None when no healthy worker is left."""

    def block_hashes(self, request: RouteRequest, block_size: int | None = None) -> Sequence[bytes] | None:
        """The prompt's chained block hashes this policy routes by, or None when it routes by none
        (the default) or cannot hash yet (no block size known). `block_size` is the workers'."""
        return None

    def prefix_match(self, request: RouteRequest, workers: Sequence[WorkerView]) -> dict[str, int]:
        """worker_id -> leading prompt blocks that worker caches; {} when this policy tracks none."""
        return {}


class RoundRobin(RoutingPolicy):
    """One turn counter per pool (the roles of the workers it picks from): with one shared counter,
    a disaggregated request's prefill and decode picks alternate on it, so with two workers per
    pool every prefill would land on the first worker and every decode on the second."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next: dict[frozenset[str], int] = {}  # at most one entry per combination of roles

    def pick(self, request: RouteRequest, workers: Sequence[WorkerView], stats: StatsMap) -> WorkerView | None:
        candidates = _healthy(workers)
        if not candidates:
            return None
        pool = frozenset(w.role for w in workers)
        turn = self._next.get(pool, 0)
        self._next[pool] = turn + 1
        return candidates[turn % len(candidates)]


class LeastLoaded(RoutingPolicy):
    """Shortest queue, then lowest KV usage, then list order (deterministic)."""

    name = "least_loaded"

    def pick(self, request: RouteRequest, workers: Sequence[WorkerView], stats: StatsMap) -> WorkerView | None:
        candidates = _healthy(workers)
        if not candidates:
            return None
        return min(candidates, key=lambda w: _load_key(stats, w))


class PowerOfTwo(RoutingPolicy):
    """Less loaded of two random workers: near least-loaded balance, but robust to stale stats
    (many routers do not all stampede the same 'least loaded' worker)."""

    name = "power_of_two"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def pick(self, request: RouteRequest, workers: Sequence[WorkerView], stats: StatsMap) -> WorkerView | None:
        candidates = _healthy(workers)
        if len(candidates) <= 1:
            return candidates[0] if candidates else None
        a, b = self._rng.sample(candidates, 2)
        return a if _load_key(stats, a) <= _load_key(stats, b) else b


def _compute_block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None) -> list[bytes]:
    # Imported lazily: the router needs the engine's exact hash function (a cached prefix is
    # only found if both sides hash identically) but not the rest of the engine at import.
    from pdcluster.engine.block_hash import compute_block_hashes

    return list(compute_block_hashes(list(token_ids), block_size, cache_salt=cache_salt))


def _hashable_share(request: RouteRequest) -> float:
    """The part of the prompt the chain covers: 1 without images, else the text before the first
    placeholder over the whole prompt, so a cached text prefix of an image-heavy prompt scores as
    the small part of it that it is (the chain alone would call it 'fully cached')."""
    n = len(request.prompt_token_ids)
    if request.mm_offset is None or n == 0:
        return 1.0
    return min(1.0, max(0, request.mm_offset) / n)


class PrefixAware(RoutingPolicy):
    """Prefer the worker that already caches the longest prefix of the prompt, unless it is
    much busier than the others:

        score(w) = matched_blocks(w) / num_blocks  -  load_weight * queue_len(w) / max_queue_len

    Both terms are in [0, 1]: with load_weight=0.5 a fully cached but busiest worker still beats
    an idle one with nothing cached, while a half-cached busiest worker ties an idle uncached
    one. Ties go to the less loaded worker. With no cached overlap anywhere it falls back to
    least_loaded (scores would all be load-only anyway; this keeps the two policies consistent).
    With images the chain ends before the first placeholder block and the first term is scaled
    by the share of the prompt before it (`_hashable_share`).
    """

    name = "prefix_aware"

    def __init__(
        self,
        index: PrefixIndex,
        *,
        block_size: int | None = None,
        load_weight: float = 0.5,
        hash_fn: Callable[[Sequence[int], int, str | None], Sequence[bytes]] | None = None,
        fallback: RoutingPolicy | None = None,
    ) -> None:
        if load_weight < 0:
            raise ValueError("load_weight must be >= 0")
        self.index = index
        self.block_size = block_size
        self.load_weight = load_weight
        self._hash_fn = hash_fn or _compute_block_hashes
        self.fallback = fallback or LeastLoaded()

    def block_hashes(self, request: RouteRequest, block_size: int | None = None) -> Sequence[bytes] | None:
        """Precomputed hashes win; else the prompt hashed with `block_size` (the workers', from the
        router) or, without one, the block size this policy was built with."""
        if request.block_hashes is not None:
            return request.block_hashes
        size = block_size if block_size is not None else self.block_size
        if size is None:
            return None
        tokens = request.prompt_token_ids
        if request.mm_offset is not None:
            # Blocks ending at or before the first placeholder carry no image key on the workers
            # (engine/mm_inputs.block_extra_keys), so their hashes equal these token-only ones.
            tokens = tokens[:max(0, request.mm_offset)]
        if len(tokens) < size:
            return ()
        return self._hash_fn(tokens, size, request.cache_salt)

    def pick(self, request: RouteRequest, workers: Sequence[WorkerView], stats: StatsMap) -> WorkerView | None:
        candidates = _healthy(workers)
        hashes = self.block_hashes(request) or ()
        matched = self.index.match(hashes, [w.worker_id for w in candidates]) if hashes else {}
        if not matched:
            return self.fallback.pick(request, candidates, stats)
        max_queue = max(1, max(_load_key(stats, w)[0] for w in candidates))
        share = _hashable_share(request)

        def rank(w: WorkerView) -> tuple[float, int, float]:
            queue_len, kv_usage = _load_key(stats, w)
            cached = share * matched.get(w.worker_id, 0) / len(hashes)
            score = cached - self.load_weight * queue_len / max_queue
            return (-score, queue_len, kv_usage)  # min() -> best score, then least loaded

        return min(candidates, key=rank)

    def prefix_match(self, request: RouteRequest, workers: Sequence[WorkerView]) -> dict[str, int]:
        """Matched blocks per worker, healthy or not (for the router's conditional disaggregation)."""
        hashes = self.block_hashes(request)
        return self.index.match(hashes, [w.worker_id for w in workers]) if hashes else {}


def _build_registry() -> Registry[type[RoutingPolicy]]:
    # Closed set: the router's config validates the name up front, so no dotted paths or plugins.
    registry: Registry[type[RoutingPolicy]] = Registry(
        "routing policy", check=subclass_of(RoutingPolicy), allow_dotted=False)
    for cls in (RoundRobin, LeastLoaded, PowerOfTwo, PrefixAware):
        registry.register(cls.name, cls)
    return registry


ROUTING_POLICIES = _build_registry()
# name -> class, read-only (config validation and tests read it; the registry stays the one source).
POLICIES: Mapping[str, type[RoutingPolicy]] = MappingProxyType(
    {name: ROUTING_POLICIES.get(name) for name in ROUTING_POLICIES.names()})


def make_policy(name: str, **kwargs: Any) -> RoutingPolicy:
    """A policy by registry name; kwargs go to its constructor (prefix_aware needs index=)."""
    return ROUTING_POLICIES.get(name)(**kwargs)
