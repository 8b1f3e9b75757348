"""WorkerCollector: the worker's Prometheus metrics, read at scrape time from what already exists.

    engine.get_stats()      the snapshot the engine thread swaps after every step (scheduler,
                            KV cache, prefix cache, and the connector's counters under
                            "kv_connector")                      -> pdcluster_engine_*, pdcluster_connector_*
    engine.counters         tokens served, step-time histogram   -> pdcluster_engine_*
    role.role_metrics()     the role's own view of the stats     -> pdcluster_role_*
    servicer.requests       the drain flag, legs ended by a failed caller
                                                                 -> pdcluster_worker_draining,
                                                                    pdcluster_worker_requests_ended_total
    KV-event CURVE auth     its refusal counter (private registry) -> pdcluster_zmq_handshake_refusals_total

Nothing runs per engine step for this: a scrape costs one snapshot read. Names follow
`pdcluster_<component>_<what>_<unit>`, counters end in `_total`. Connector counters are mapped
by key (CONNECTOR_COUNTERS); a key a connector reports that is not in the table (a plugin's)
still shows, as pdcluster_connector_stat_value{name=KEY}.

EC (encoder cache) names are fixed here for the EC work but exported only when the engine
stats carry an "ec_connector" mapping (keys mm_items_computed, mm_items_local_cache,
mm_items_remote, transfer_bytes, errors_<reason>); no EC connector, no EC metrics, except that a
multimodal engine's own counts (stats mm_items_computed / mm_items_local_cache, its encoder
cache) are exported as pdcluster_mm_items_total{source=computed|local_cache}.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

if TYPE_CHECKING:
    from pdcluster.engine.async_engine import AsyncEngine
    from pdcluster.worker.role_registry import WorkerRole

EC_MM_ITEMS = "pdcluster_mm_items_total"  # {source=computed|local_cache|remote}
EC_TRANSFER_BYTES = "pdcluster_ec_transfer_bytes_total"
EC_ERRORS = "pdcluster_ec_errors_total"  # {reason}
EC_MM_SOURCES = ("computed", "local_cache", "remote")

# Engine stats key -> (gauge name, help). Missing keys (log_stats off) are skipped.
ENGINE_GAUGES: Mapping[str, tuple[str, str]] = {
    "num_running": ("pdcluster_engine_running_requests", "Requests running in the engine"),
    "num_waiting": ("pdcluster_engine_waiting_requests", "Requests waiting to be scheduled"),
    "num_waiting_for_remote_kv": ("pdcluster_engine_waiting_for_remote_kv_requests",
                                  "Requests waiting for their KV from a peer or the store"),
    "num_held_for_transfer": ("pdcluster_engine_held_for_transfer_requests",
                              "Finished requests whose blocks are held until a peer read them"),
    "kv_blocks_used": ("pdcluster_engine_kv_cache_used_blocks", "KV cache blocks in use"),
    "kv_blocks_total": ("pdcluster_engine_kv_cache_total_blocks", "KV cache blocks in all"),
    "kv_blocks_free": ("pdcluster_engine_kv_cache_free_blocks", "KV cache blocks free"),
    "kv_blocks_cached": ("pdcluster_engine_kv_cache_cached_blocks", "KV cache blocks holding a cached prefix"),
    "kv_cache_usage": ("pdcluster_engine_kv_cache_usage_ratio", "Fraction of the KV cache in use"),
    "prefix_cache_hit_rate": ("pdcluster_engine_prefix_cache_hit_ratio",
                              "Prefix-cache hit rate since start (use the _tokens_total counters for a window)"),
}
ENGINE_COUNTERS: Mapping[str, tuple[str, str]] = {
    "prefix_cache_queries": ("pdcluster_engine_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache"),
    "prefix_cache_hits": ("pdcluster_engine_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache"),
    "external_prefix_hits": ("pdcluster_engine_external_prefix_hit_tokens",
                             "Prompt tokens loaded through the KV connector instead of computed"),
    "num_preemptions": ("pdcluster_engine_preemptions", "Requests preempted (their blocks taken back)"),
    "spec_decode_drafts": ("pdcluster_engine_spec_decode_drafts", "Decode steps of a request that checked drafts"),
    "spec_decode_draft_tokens": ("pdcluster_engine_spec_decode_draft_tokens", "Draft tokens proposed"),
    "spec_decode_accepted_tokens": ("pdcluster_engine_spec_decode_accepted_tokens",
                                    "Draft tokens the model agreed with (kept)"),
}

# Connector stats key -> (counter name without _total, labels, help). p2p_* from connectors/p2p,
# store_* from connectors/store.
CONNECTOR_COUNTERS: Mapping[str, tuple[str, Mapping[str, str], str]] = {
    "p2p_bytes_tcp": ("pdcluster_connector_loaded_bytes", {"transport": "tcp"}, "KV bytes loaded from peers"),
    "p2p_bytes_shm": ("pdcluster_connector_loaded_bytes", {"transport": "shm"}, "KV bytes loaded from peers"),
    "store_load_bytes": ("pdcluster_connector_loaded_bytes", {"transport": "store"}, "KV bytes loaded from peers"),
    "p2p_bytes_served": ("pdcluster_connector_served_bytes", {}, "KV bytes peers read from this worker (TCP)"),
    "store_save_bytes": ("pdcluster_connector_saved_bytes", {}, "KV bytes saved to the store"),
    "p2p_loads_ok": ("pdcluster_connector_loads", {"result": "ok"}, "KV loads finished"),
    "p2p_loads_failed": ("pdcluster_connector_loads", {"result": "failed"}, "KV loads finished"),
    "p2p_loads_issued": ("pdcluster_connector_loads_issued", {}, "KV loads the scheduler started"),
    "p2p_leases_issued": ("pdcluster_connector_leases_issued", {}, "Leases the scheduler offered peers"),
    "p2p_leases_created": ("pdcluster_connector_leases", {"state": "created"}, "Leases by how they ended"),
    "p2p_leases_released": ("pdcluster_connector_leases", {"state": "released"}, "Leases by how they ended"),
    "p2p_leases_expired": ("pdcluster_connector_leases", {"state": "expired"}, "Leases by how they ended"),
    "p2p_leases_aborted": ("pdcluster_connector_leases", {"state": "aborted"}, "Leases by how they ended"),
    "store_load_blocks": ("pdcluster_connector_loaded_blocks", {}, "KV blocks loaded"),
    "store_save_blocks": ("pdcluster_connector_saved_blocks", {}, "KV blocks queued for saving"),
    "store_load_failed_blocks": ("pdcluster_connector_failed_blocks", {"op": "load"}, "KV blocks that failed"),
    "p2p_failed_blocks": ("pdcluster_connector_failed_blocks", {"op": "load"}, "KV blocks that failed"),
    "p2p_open_retries": ("pdcluster_connector_not_ready_retries", {},
                         "Transfer opens retried because the producer had not registered the lease yet"),
    "store_save_failed_blocks": ("pdcluster_connector_failed_blocks", {"op": "save"}, "KV blocks that failed"),
    "store_save_dropped_blocks": ("pdcluster_connector_dropped_blocks", {}, "KV blocks not saved (queue full)"),
    "store_load_cancelled": ("pdcluster_connector_cancelled_loads", {}, "KV loads cancelled"),
    "store_load_requests": ("pdcluster_connector_load_requests", {}, "Requests that load KV from the store"),
    "store_lookups": ("pdcluster_connector_lookups", {}, "Store lookups"),
    "store_lookup_errors": ("pdcluster_connector_lookup_errors", {}, "Store lookups that failed"),
    "store_query_tokens": ("pdcluster_connector_queried_tokens", {}, "Prompt tokens looked up in the store"),
    "store_hit_tokens": ("pdcluster_connector_hit_tokens", {}, "Prompt tokens found in the store"),
    "store_put_stored": ("pdcluster_connector_puts", {"result": "stored"}, "Store puts by result"),
    "store_put_exists": ("pdcluster_connector_puts", {"result": "exists"}, "Store puts by result"),
    "store_put_failed": ("pdcluster_connector_puts", {"result": "failed"}, "Store puts by result"),
    "store_foreign_key_prefix": ("pdcluster_connector_foreign_key_prefix", {}, "Handoffs with another key prefix"),
}
CONNECTOR_GAUGES: Mapping[str, tuple[str, str]] = {
    "p2p_leases_active": ("pdcluster_connector_active_leases", "Leases held by peers now"),
    "p2p_loads_in_flight": ("pdcluster_connector_loads_in_flight", "KV loads running now"),
    "store_hit_rate": ("pdcluster_connector_hit_ratio", "Store hit rate since start"),
}
# Connector stats key -> (histogram name, labels): the value is {"bounds", "counts", "sum"}
# (per-bucket counts, the last one +Inf; connectors/p2p/load_times.py). One connector per worker,
# so at most one of them is present.
CONNECTOR_HISTOGRAMS: Mapping[str, tuple[str, Mapping[str, str]]] = {
    "p2p_load_seconds": ("pdcluster_connector_transfer_duration_seconds", {"op": "load"}),
    "store_load_seconds": ("pdcluster_connector_transfer_duration_seconds", {"op": "load"}),
}
# Counted by reason: "p2p_refused_lease_unknown" -> reason="lease_unknown" (the producer's answer
# to a consumer that opened before the lease was registered: the consumer retries it).
REFUSAL_PREFIXES = ("p2p_refused_", "p2p_data_refused_")
SIDE_CHANNEL_REFUSALS = "p2p_side_channel_refusals"  # a total only: the connector keeps no reasons
SIDE_CHANNEL_REQUESTS = "p2p_requests_"


class WorkerCollector(Collector):
    def __init__(self, engine: AsyncEngine, role: WorkerRole, *, worker_id: str, connector: str | None,
                 requests: Any = None, handshake_registry: Any = None) -> None:
        self.engine = engine
        self.role = role
        self.worker_id = worker_id
        self.connector = connector or ""
        self.requests = requests  # the RequestTable (its `draining` flag), or None
        self.handshake_registry = handshake_registry  # the KV-event CURVE auth's registry, or None

    def describe(self) -> list[Metric]:
        return []  # no fixed set (connectors differ); registering must not call collect()

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.get_stats()
        info = GaugeMetricFamily("pdcluster_worker_info", "This worker", labels=["worker_id", "role", "connector"])
        info.add_metric([self.worker_id, self.role.name, self.connector], 1)
        yield info
        draining = bool(getattr(self.requests, "draining", False))
        yield GaugeMetricFamily("pdcluster_worker_draining", "1 while the worker drains (refuses new requests)",
                                value=int(draining))
        ended = getattr(self.requests, "ended", None)
        if isinstance(ended, Mapping):
            family = CounterMetricFamily("pdcluster_worker_requests_ended",
                                         "Requests this worker ended because their caller failed them: its deadline "
                                         "passed, or the request stream ended under them", labels=["reason"])
            for reason, n in ended.items():
                family.add_metric([reason], float(n))
            yield family
        yield from engine_families(stats, self.engine)
        yield from role_families(self.role, stats)
        connector_stats = stats.get("kv_connector")
        if isinstance(connector_stats, Mapping):
            yield from connector_families(connector_stats)
        yield from handshake_families(self.handshake_registry, connector_stats)
        ec_stats = stats.get("ec_connector")
        if isinstance(ec_stats, Mapping):
            yield from ec_families(ec_stats)
        elif "mm_items_computed" in stats:
            yield mm_items_family(stats, ("computed", "local_cache"))  # no EC connector: nothing is remote


def engine_families(stats: Mapping[str, Any], engine: AsyncEngine) -> Iterator[Metric]:
    for key, (name, doc) in ENGINE_GAUGES.items():
        if key in stats:
            yield GaugeMetricFamily(name, doc, value=float(stats[key]))
    for key, (name, doc) in ENGINE_COUNTERS.items():
        if key in stats:
            yield CounterMetricFamily(name, doc, value=float(stats[key]))
    snap = engine.counters.snapshot()
    yield CounterMetricFamily("pdcluster_engine_prompt_tokens", "Prompt tokens of requests served",
                              value=snap.prompt_tokens)
    yield CounterMetricFamily("pdcluster_engine_generation_tokens", "Tokens generated", value=snap.generation_tokens)
    buckets, running = [], 0
    for bound, count in zip((*snap.step_time_bounds_s, float("inf")), snap.step_time_counts):
        running += count
        buckets.append((floatToGoString(bound), running))
    yield HistogramMetricFamily("pdcluster_engine_step_duration_seconds", "Engine step time", buckets=buckets,
                                sum_value=snap.step_time_sum_s)


def role_families(role: WorkerRole, stats: Mapping[str, Any]) -> Iterator[Metric]:
    """The role's own metrics (WorkerRole.metrics): num_X -> pdcluster_role_X_requests{role}."""
    for key, value in role.role_metrics(stats).items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue  # e.g. kv_connector, a mapping: exported as pdcluster_connector_*
        name = f"pdcluster_role_{key[4:]}_requests" if key.startswith("num_") else f"pdcluster_role_{key}"
        family = GaugeMetricFamily(name, f"{key} as the {role.name} role reports it", labels=["role"])
        family.add_metric([role.name], float(value))
        yield family


def connector_families(stats: Mapping[str, Any]) -> Iterator[Metric]:
    counters: dict[str, CounterMetricFamily] = {}
    refusals = CounterMetricFamily("pdcluster_connector_refusals", "Transfer-plane requests the connector refused",
                                   labels=["reason"])
    requests = CounterMetricFamily("pdcluster_connector_side_channel_requests",
                                   "Side-channel requests served, by kind", labels=["kind"])
    other = GaugeMetricFamily("pdcluster_connector_stat_value", "Connector counters without a mapped name",
                              labels=["name"])
    for key, value in sorted(stats.items()):
        if key in CONNECTOR_HISTOGRAMS and isinstance(value, Mapping):
            yield histogram_family(*CONNECTOR_HISTOGRAMS[key], value)
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if key in CONNECTOR_COUNTERS:
            name, labels, doc = CONNECTOR_COUNTERS[key]
            family = counters.get(name)
            if family is None:
                family = counters[name] = CounterMetricFamily(name, doc, labels=sorted(labels))
            family.add_metric([labels[k] for k in sorted(labels)], float(value))
        elif key in CONNECTOR_GAUGES:
            name, doc = CONNECTOR_GAUGES[key]
            yield GaugeMetricFamily(name, doc, value=float(value))
        elif key.startswith(REFUSAL_PREFIXES):
            reason = key[len("p2p_"):].removeprefix("refused_")  # data_refused_X keeps its data_ prefix
            refusals.add_metric([reason], float(value))
        elif key.startswith(SIDE_CHANNEL_REQUESTS):
            requests.add_metric([key[len(SIDE_CHANNEL_REQUESTS):]], float(value))
        elif key != SIDE_CHANNEL_REFUSALS:
            other.add_metric([key], float(value))
    yield from counters.values()
    for family in (refusals, requests, other):
        if family.samples:
            yield family


def histogram_family(name: str, labels: Mapping[str, str], value: Mapping[str, Any]) -> Metric:
    """A connector's {"bounds", "counts", "sum"} as one Prometheus histogram (cumulative buckets)."""
    family = HistogramMetricFamily(name, "KV transfer time (successful pulls)", labels=sorted(labels))
    buckets, running = [], 0
    for bound, count in zip((*value.get("bounds", ()), float("inf")), value.get("counts", ())):
        running += int(count)
        buckets.append((floatToGoString(bound), running))
    family.add_metric([labels[k] for k in sorted(labels)], buckets, float(value.get("sum", 0.0)))
    return family


def handshake_families(registry: Any, connector_stats: Any) -> Iterator[Metric]:
    """One pdcluster_zmq_handshake_refusals_total{socket, reason}: the KV-event sockets' counts
    (from their authenticator's private registry, as curve.HandshakeMetrics keeps them) and the
    P2P side channel's total (reason="any": the connector reports no breakdown)."""
    family = CounterMetricFamily("pdcluster_zmq_handshake_refusals", "ZMQ CURVE handshakes refused by a server socket",
                                 labels=["socket", "reason"])
    if registry is not None:
        for metric in registry.collect():
            for sample in metric.samples:
                if sample.name == "pdcluster_zmq_handshake_refusals_total":
                    family.add_metric([sample.labels.get("socket", ""), sample.labels.get("reason", "")], sample.value)
    if isinstance(connector_stats, Mapping) and SIDE_CHANNEL_REFUSALS in connector_stats:
        family.add_metric(["p2p-side-channel", "any"], float(connector_stats[SIDE_CHANNEL_REFUSALS]))
    yield family


def mm_items_family(stats: Mapping[str, Any], sources: tuple[str, ...] = EC_MM_SOURCES) -> Metric:
    """pdcluster_mm_items_total{source}: images encoded here, served from the engine's encoder
    cache, or (with an EC connector) fetched from another instance."""
    items = CounterMetricFamily(EC_MM_ITEMS.removesuffix("_total"), "Multimodal items by where their encoding came from",
                                labels=["source"])
    for source in sources:
        items.add_metric([source], float(stats.get(f"mm_items_{source}", 0)))
    return items


def ec_families(stats: Mapping[str, Any]) -> Iterator[Metric]:
    """The fixed EC names (DESIGN.md 13) from an EC connector's stats mapping."""
    yield mm_items_family(stats)
    yield CounterMetricFamily(EC_TRANSFER_BYTES.removesuffix("_total"), "Encoder-cache bytes transferred",
                              value=float(stats.get("transfer_bytes", 0)))
    errors = CounterMetricFamily(EC_ERRORS.removesuffix("_total"), "Encoder-cache errors by reason", labels=["reason"])
    for key, value in sorted(stats.items()):
        if key.startswith("errors_"):
            errors.add_metric([key[len("errors_"):]], float(value))
    yield errors
