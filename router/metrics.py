"""RouterMetrics: the router's Prometheus metrics, in a CollectorRegistry of its own.

A registry per router (never prometheus_client's global one) so several routers, and tests,
live in one process. Per-request series (requests, errors, TTFT, ITL) are updated on the hot
path; per-worker gauges (in-flight, queue, health, KV usage) and KV-event counters are read from
the registry at scrape time by a custom collector, so routing pays nothing for them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

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
        self.requests = Counter("pdcluster_router_requests", "Requests finished, by frontend and status",
                                ["frontend", "status"], registry=r)
        self.errors = Counter("pdcluster_router_errors", "Requests that ended in an error, by gRPC code",
                              ["code"], registry=r)
        self.rejected = Counter("pdcluster_router_admission_rejections",
                                "Requests refused by admission control (max in-flight reached)", registry=r)
        self.retries = Counter("pdcluster_router_retries", "Worker legs retried on another worker", ["role"], registry=r)
        self.ttft = Histogram("pdcluster_router_time_to_first_token_seconds", "Time to first token seen by the router",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("pdcluster_router_inter_token_latency_seconds", "Time between streamed tokens",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("pdcluster_router_request_duration_seconds", "Request duration in the router",
                             buckets=_E2E_BUCKETS, registry=r)
        self.inflight = Gauge("pdcluster_router_inflight_requests", "Requests in flight in the router", registry=r)
        self.prompt_tokens = Counter("pdcluster_router_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("pdcluster_router_generation_tokens", "Tokens streamed to clients", registry=r)
        self.disagg = Counter("pdcluster_router_disaggregated_requests", "Requests by serving mode", ["mode"],
                              registry=r)
        self.prefill_leg = Histogram("pdcluster_router_prefill_leg_seconds",
                                     "Prefill leg duration (disaggregated: includes KV hand-off setup)",
                                     buckets=_TTFT_BUCKETS, registry=r)
        self.kv_transfer_tokens = Counter("pdcluster_router_kv_transfer_tokens",
                                          "Prompt tokens handed from prefill to decode workers", registry=r)

        self.aggregated = self.disagg.labels("aggregated")
        self.disaggregated = self.disagg.labels("disaggregated")
        self._request_children: dict[tuple[str, str], tuple] = {}

    def count_request(self, frontend: str, status: str) -> None:
        """One finished or refused request; label children cached (labels() costs ~10 us)."""
        children = self._request_children.get((frontend, status))
        if children is None:
            children = (self.requests.labels(frontend, status), self.errors.labels(status) if status != "OK" else None)
            self._request_children[(frontend, status)] = children
        children[0].inc()
        if children[1] is not None:
            children[1].inc()

    def attach(self, workers: WorkerRegistry, kv_sync: KVEventSync | None) -> None:
        self.registry.register(_WorkerCollector(workers, kv_sync))

    def observe_tokens(self, num_tokens: int, now: float, last: float) -> None:
        """ITL for a message of num_tokens that arrived at `now`, the previous one at `last`:
        tokens that arrive together share the gap (a worker may batch several per message)."""
        if num_tokens <= 0:
            return
        gap = (now - last) / num_tokens
        for _ in range(num_tokens):
            self.itl.observe(gap)

    def render(self) -> bytes:
        return generate_latest(self.registry)


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
            "pdcluster_router_worker_kv_usage": (
                GaugeMetricFamily("pdcluster_router_worker_kv_usage", "KV cache use of the worker, [0, 1]",
                                  labels=labels), lambda h: h.stats.kv_usage if h.stats else 0.0),
        }
        ejections = CounterMetricFamily("pdcluster_router_worker_ejections", "Times the worker was ejected",
                                        labels=labels)
        for h in self._workers.handles:
            lv = [h.worker_id, h.address, h.role]
            for family, value in gauges.values():
                family.add_metric(lv, value(h))
            ejections.add_metric(lv, h.breaker.num_ejections)
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
