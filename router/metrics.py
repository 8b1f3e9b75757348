"""RouterMetrics: the router's Prometheus metrics, in a CollectorRegistry of its own.

A registry per router (never prometheus_client's global one) so several routers, and tests,
live in one process. Per-request series (requests, errors, TTFT, ITL, E2E, token counts, serving
mode) are updated on the hot path by the event loop alone, so they are plain numbers without
locks (_LoopCounter, _LoopHistogram; prometheus_client's take a lock per update, ~1-2 us each,
8-10 per request) exported at scrape time with the same names, labels and samples. Per-worker
gauges (in-flight, queue, health, KV usage) and KV-event counters are read from the registry at
scrape time by a custom collector, so routing pays nothing for them. Rare events (retries,
admission rejections, disaggregated legs) keep prometheus_client's own types.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from .disagg_rule import LOCAL_REASONS
from .kv_sync import KVEventSync
from .registry import WorkerRegistry

# Latency buckets from sub-millisecond (router overhead, tiny models) to a minute.
_TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        hot = _HotPathCollector()
        self.requests = hot.counter("pdcluster_router_requests", "Requests finished, by frontend and status",
                                    ("frontend", "status"))
        self.errors = hot.counter("pdcluster_router_errors", "Requests that ended in an error, by gRPC code", ("code",))
        self.rejected = Counter("pdcluster_router_admission_rejections",
                                "Requests refused by admission control (max in-flight reached)", registry=r)
        self.retries = Counter("pdcluster_router_retries", "Worker legs retried on another worker", ["role"], registry=r)
        self.migrations = Counter("pdcluster_router_migrations",
                                  "Requests resumed on another worker after output was streamed, by reason",
                                  ["reason"], registry=r)
        self.migrations_exhausted = Counter("pdcluster_router_migrations_exhausted",
                                            "Requests that failed after using up their migrations", registry=r)
        self.ttft = hot.histogram("pdcluster_router_time_to_first_token_seconds",
                                  "Time to first token seen by the router", _TTFT_BUCKETS)
        self.itl = hot.histogram("pdcluster_router_inter_token_latency_seconds", "Time between streamed tokens",
                                 _ITL_BUCKETS)
        self.e2e = hot.histogram("pdcluster_router_request_duration_seconds", "Request duration in the router",
                                 _E2E_BUCKETS)
        self.inflight = Gauge("pdcluster_router_inflight_requests", "Requests in flight in the router", registry=r)
        self.prompt_tokens = hot.counter("pdcluster_router_prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = hot.counter("pdcluster_router_generation_tokens", "Tokens streamed to clients")
        self.disagg = hot.counter("pdcluster_router_disaggregated_requests", "Requests by serving mode", ("mode",))
        # Requests a decode worker prefilled itself while both pools were up (disagg_rule.py).
        self.decode_prefills = hot.counter("pdcluster_router_decode_prefills",
                                           "Requests a decode worker prefilled itself with a prefill pool up, by reason",
                                           ("reason",))
        self.prefill_leg = Histogram("pdcluster_router_prefill_leg_seconds",
                                     "Prefill leg duration (disaggregated: includes KV hand-off setup)",
                                     buckets=_TTFT_BUCKETS, registry=r)
        self.kv_transfer_tokens = Counter("pdcluster_router_kv_transfer_tokens",
                                          "Prompt tokens handed from prefill to decode workers", registry=r)
        # Encoder-cache sharing (router/ec_stage.py): Encode calls by outcome, EC params attached to
        # legs by where they came from (an encoder, or a worker that encoded the image earlier).
        self.ec_encodes = hot.counter("pdcluster_router_ec_encodes", "Encode calls to encode workers, by result",
                                      ("result",))
        self.ec_attached = hot.counter("pdcluster_router_ec_params_attached",
                                       "EC params attached to requests, by source", ("source",))
        self.encode_leg = Histogram("pdcluster_router_encode_leg_seconds", "Encode call duration (encoder stage)",
                                    buckets=_TTFT_BUCKETS, registry=r)
        r.register(hot)

        # Both modes are exported from the start (0 until used), as with labels() children.
        self.aggregated = self.disagg.labels("aggregated")
        self.disaggregated = self.disagg.labels("disaggregated")
        for reason in LOCAL_REASONS:
            self.decode_prefills.labels(reason)

    def count_request(self, frontend: str, status: str) -> None:
        """One finished or refused request."""
        self.requests.labels(frontend, status).inc()
        if status != "OK":
            self.errors.labels(status).inc()

    def attach(self, workers: WorkerRegistry, kv_sync: KVEventSync | None) -> None:
        self.registry.register(_WorkerCollector(workers, kv_sync))

    def observe_tokens(self, num_tokens: int, now: float, last: float) -> None:
        """ITL for a message of num_tokens that arrived at `now`, the previous one at `last`:
        tokens that arrive together share the gap (a worker may batch several per message)."""
        if num_tokens <= 0:
            return
        self.itl.observe((now - last) / num_tokens, num_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _LoopCounter:
    """A counter (or one label set of one) for the event loop alone: no lock."""

    __slots__ = ("value", "created")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1) -> None:
        self.value += amount


class _LoopCounterFamily:
    """prometheus_client's Counter API subset the router uses: inc() without labels, or
    labels(*values).inc(); the children are cached (labels() itself is cheap here)."""

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...]) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, labelnames
        self.children: dict[tuple[str, ...], _LoopCounter] = {}
        self._unlabelled = None if labelnames else self.labels()

    def labels(self, *values: str) -> _LoopCounter:
        child = self.children.get(values)
        if child is None:
            child = self.children[values] = _LoopCounter()
        return child

    def inc(self, amount: float = 1) -> None:
        self._unlabelled.inc(amount)

    def families(self) -> Iterator[Metric]:
        total = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in list(self.children.items()):
            total.add_metric(values, child.value, created=child.created)
        yield total


class _LoopHistogram:
    """A histogram for the event loop alone: a bisect and two additions per observation."""

    def __init__(self, name: str, documentation: str, buckets: Iterable[float]) -> None:
        self.name, self.documentation = name, documentation
        self.bounds = tuple(float(b) for b in buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum = 0.0
        self.created = time.time()

    def observe(self, value: float, times: int = 1) -> None:
        # bisect_left: the first bound >= value, i.e. prometheus' `value <= le`.
        self.counts[bisect_left(self.bounds, value)] += times
        self.sum += value * times

    def families(self) -> Iterator[Metric]:
        cumulative, buckets = 0, []
        for bound, n in zip((*self.bounds, float("inf")), list(self.counts)):
            cumulative += n
            buckets.append((floatToGoString(bound), cumulative))
        yield HistogramMetricFamily(self.name, self.documentation, buckets=buckets, sum_value=self.sum)
        # prometheus_client's text format shows a histogram's creation time as a gauge beside it.
        yield GaugeMetricFamily(self.name + "_created", self.documentation, value=self.created)


class _HotPathCollector(Collector):
    def __init__(self) -> None:
        self._metrics: list[_LoopCounterFamily | _LoopHistogram] = []

    def counter(self, name: str, documentation: str, labelnames: tuple[str, ...] = ()) -> _LoopCounterFamily:
        self._metrics.append(_LoopCounterFamily(name, documentation, labelnames))
        return self._metrics[-1]

    def histogram(self, name: str, documentation: str, buckets: Iterable[float]) -> _LoopHistogram:
        self._metrics.append(_LoopHistogram(name, documentation, buckets))
        return self._metrics[-1]

    def collect(self) -> Iterator[Metric]:
        for metric in self._metrics:
            yield from metric.families()


class _WorkerCollector(Collector):
    def __init__(self, workers: WorkerRegistry, kv_sync: KVEventSync | None) -> None:
        self._workers = workers
        self._kv_sync = kv_sync

    def collect(self) -> Iterator[Metric]:
        labels = ["worker", "address", "role"]
        gauges: dict[str, tuple[GaugeMetricFamily, Callable]] = {
            "pdcluster_router_worker_inflight": (
                GaugeMetricFamily("pdcluster_router_worker_inflight", "Requests this router has on the worker",
                                  labels=labels), lambda h: h.num_inflight),
            "pdcluster_router_worker_healthy": (
                GaugeMetricFamily("pdcluster_router_worker_healthy", "1 when the worker takes traffic",
                                  labels=labels), lambda h: float(h.healthy)),
            "pdcluster_router_worker_queue_depth": (
                GaugeMetricFamily("pdcluster_router_worker_queue_depth", "Requests waiting on the worker (Stats)",
                                  labels=labels), lambda h: h.stats.num_waiting if h.stats else 0),
            "pdcluster_router_worker_running": (
                GaugeMetricFamily("pdcluster_router_worker_running", "Requests running on the worker (Stats)",
                                  labels=labels), lambda h: h.stats.num_running if h.stats else 0),
            "pdcluster_router_worker_prefill_backlog_tokens": (
                GaugeMetricFamily("pdcluster_router_worker_prefill_backlog_tokens",
                                  "Prompt tokens this router sent the worker to compute, not yet prefilled",
                                  labels=labels), lambda h: h.prefill_backlog),
            "pdcluster_router_worker_kv_usage": (
                GaugeMetricFamily("pdcluster_router_worker_kv_usage", "KV cache use of the worker, [0, 1]",
                                  labels=labels), lambda h: h.stats.kv_usage if h.stats else 0.0),
        }
        ejections = CounterMetricFamily("pdcluster_router_worker_ejections", "Times the worker was ejected",
                                        labels=labels)
        for h in self._workers.handles:
            label_values = [h.worker_id, h.address, h.role]
            for family, value in gauges.values():
                family.add_metric(label_values, value(h))
            ejections.add_metric(label_values, h.breaker.num_ejections)
        yield from (family for family, _ in gauges.values())
        yield ejections
        if self._kv_sync is not None:
            yield from _kv_families(self._kv_sync)


def _kv_families(kv_sync: KVEventSync) -> Iterator[Metric]:
    refusals = CounterMetricFamily("pdcluster_router_kv_event_refusals",
                                   "KV-event publishers or batches the router refused, by reason", labels=["reason"])
    for reason, n in kv_sync.refusals.items():
        refusals.add_metric([reason], n)
    refusals.add_metric(["malformed"], kv_sync.num_malformed)
    yield refusals
    resyncs = CounterMetricFamily("pdcluster_router_kv_event_resyncs", "KV-event snapshot resyncs, by worker",
                                  labels=["worker"])
    for worker_id, n in kv_sync.num_resyncs().items():
        resyncs.add_metric([worker_id], n)
    yield resyncs
    blocks = GaugeMetricFamily("pdcluster_router_prefix_index_blocks", "Distinct block hashes in the prefix index")
    blocks.add_metric([], len(kv_sync.index))
    yield blocks
