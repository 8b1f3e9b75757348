"""The encoder-cache (EC) connector contract: the engine's port for sharing encoder outputs.

Beside kv_connector.py and like it owned by the engine: adapters (connectors/ec/ "p2p_ec") and
out-of-tree plugins implement it, the service hands the engine a factory or an instance
(`LLMEngine(..., ec_connector=pdcluster.connectors.ec_connector_factory)`), and the engine never
imports connectors/. Names resolve through connectors/registry.py's EC_CONNECTORS (a Registry:
built-in "p2p_ec", entry-point group `pdcluster.ec_connectors`, "pkg.module:Class").

An item is one image's encoder output, keyed by its mm_hash (engine/mm_inputs.py: the preprocessed
pixels + the encoder's fingerprint), a (num_tokens, hidden) tensor in the model dtype.

    SCHEDULER side (bookkeeping, no blocking I/O; engine thread or event loop)
        item_state(mm_hash) -> ECItemState        has: what this engine's producer holds
        reserve(mm_hashes)                        ensure: absent -> PENDING before the tower runs,
                                                  so an early consumer gets NOT_READY, not MISSING
        build_load_meta(request_id, features, params) -> ECConnectorMetadata
                                                  which items to fetch from which producer
        update_state_after_alloc(request_id, mm_hash)
                                                  a fetched item now lives in the engine's
                                                  encoder cache (the connector may drop its copy)
        request_finished(request_id, mm_hashes) -> ECTransferParams | None
                                                  producer: lease the items it holds for others

    WORKER side (moves bytes)
        save(mm_hash, output)                     PENDING -> READY: only now can it be announced
        start_load(meta) -> Future[ECLoadReport]  fetch asynchronously (own threads)
        endpoint() -> (address, public_key) | None   the producer's control endpoint (GetInfo)
        get_stats(), shutdown()

How the engine drives it (engine/async_engine.py, llm_engine.py, mm_embedder.py):
    consumer  AsyncEngine.generate(..., ec_transfer_params) awaits start_load(build_load_meta(..))
              before the request enters the scheduler (the wait is on the event loop, never the
              engine thread); each fetched output rides its MultiModalFeature; the embedder uses it
              instead of running the tower. A failed item is encoded locally (the images are in the
              request) and counted under errors_<reason>; a fetch never fails the engine.
    producer  the embedder calls save() after the tower ran; LLMEngine attaches
              request_finished() to the final RequestOutput.ec_transfer_params;
              AsyncEngine.encode() does reserve -> tower -> save -> request_finished.

The engine builds ONE instance (a factory is called once, with ECConnectorRole.WORKER) and uses it
for both sides: encoder outputs live in the engine's own process (TP > 1 is refused for LLaVA).
Tensors are typed `Any` so this module imports without torch.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdcluster.engine.ec_transfer_params import ECItemRef, ECTransferParams

if TYPE_CHECKING:
    from pdcluster.config import EngineConfig


class ECConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


class ECItemState(str, enum.Enum):
    """A producer's item:  ABSENT -reserve-> PENDING -save-> READY <-lease/release-> PINNED
    READY (unleased, LRU) or a force-dropped item -> EVICTED (remembered for a while, then ABSENT)."""

    ABSENT = "absent"
    PENDING = "pending"  # the tower is running: asked now -> retryable NOT_READY
    READY = "ready"  # bytes saved, servable, evictable (no lease)
    PINNED = "pinned"  # READY under one or more live leases: never evicted, bytes never reused
    EVICTED = "evicted"


class ECFetchError(str, enum.Enum):
    """Why an item was not fetched (the metric label errors_<value>); the request encodes locally."""

    MISSING = "missing"  # the producer never had it
    EVICTED = "evicted"  # it had it and dropped it (e.g. after announcing it, under pressure)
    NOT_READY_TIMEOUT = "not_ready_timeout"  # still PENDING when the fetch deadline passed
    LEASE = "lease"  # the lease named in the params is unknown or has expired
    INCOMPATIBLE = "incompatible"  # compatibility fingerprint differs
    UNTRUSTED = "untrusted"  # the params name a producer key outside the cluster's allow-list
    TIMEOUT = "timeout"  # the producer did not answer in time (killed, stopped, partitioned)
    TRANSFER = "transfer"  # the data plane failed (refused, io, payload MAC)
    INTEGRITY = "integrity"  # the bytes' digest did not match what the producer announced
    MALFORMED = "malformed"  # a reply or an item that is not what the schema/shape says
    PRODUCER = "producer"  # any other refusal by the producer


@dataclass(frozen=True)
class ECItemLoad:
    """One item to fetch: which, from whom, and what the engine expects back."""

    mm_hash: str
    num_tokens: int
    producer: ECTransferParams  # where it is (address, key, fingerprint)
    ref: ECItemRef


@dataclass
class ECConnectorMetadata:
    """What build_load_meta planned for one request (plain data besides the params values)."""

    request_id: str
    loads: list[ECItemLoad] = field(default_factory=list)


@dataclass
class ECLoadReport:
    """start_load's result: outputs by mm_hash, and why each other planned item failed."""

    request_id: str
    loaded: dict[str, Any] = field(default_factory=dict)  # mm_hash -> tensor (num_tokens, hidden)
    failed: dict[str, ECFetchError] = field(default_factory=dict)
    nbytes: int = 0


class ECConnectorBase(ABC):
    """Built as `cls(role, engine_config, options)`; one instance may serve both roles (the engine
    then uses it for both). `options` is EngineArgs.ec_connector_options (plain data)."""

    name: str = ""
    is_producer: bool = False  # True: the engine save()s every output its tower computes

    def __init__(self, role: ECConnectorRole, engine_config: EngineConfig, options: dict[str, Any]) -> None:
        self.role = role
        self.engine_config = engine_config
        self.options = options

    # -- scheduler side ---------------------------------------------------------------------------
    def item_state(self, mm_hash: str) -> ECItemState:
        return ECItemState.ABSENT

    def reserve(self, mm_hashes: list[str]) -> None:  # noqa: B027 - optional hook
        """Mark items this engine is about to encode as PENDING (producer)."""

    @abstractmethod
    def build_load_meta(self, request_id: str, features: list[Any],
                        params: tuple[ECTransferParams, ...]) -> ECConnectorMetadata:
        """Which of the request's features (mm_inputs.MultiModalFeature) to fetch from which of
        the params' producers. No I/O. Items the params do not list are not planned."""

    def update_state_after_alloc(self, request_id: str, mm_hash: str) -> None:  # noqa: B027
        """A fetched item was taken into the engine's encoder cache."""

    def request_finished(self, request_id: str, mm_hashes: list[str]) -> ECTransferParams | None:
        """Producer: lease the items of `mm_hashes` it holds READY for others; None if none."""
        return None

    # -- worker side ------------------------------------------------------------------------------
    def save(self, mm_hash: str, output: Any) -> None:  # noqa: B027 - consumers save nothing
        """Keep one computed encoder output (a contiguous tensor) servable under mm_hash."""

    @abstractmethod
    def start_load(self, meta: ECConnectorMetadata) -> Future[ECLoadReport]:
        """Fetch meta's items; the future never raises (failures are in the report)."""

    def endpoint(self) -> tuple[str, bytes] | None:
        """(host:port of the control endpoint, CURVE public key) of a producer; None otherwise."""
        return None

    def get_stats(self) -> dict[str, Any]:
        """Counters (plain numbers): transfer_bytes, errors_<reason>, ... merged into
        engine stats["ec_connector"]."""
        return {}

    def shutdown(self) -> None:  # noqa: B027
        """Release sockets, threads and shared memory. Idempotent."""


def done_future(report: ECLoadReport) -> Future[ECLoadReport]:
    fut: Future[ECLoadReport] = Future()
    fut.set_result(report)
    return fut


__all__ = ["ECConnectorBase", "ECConnectorMetadata", "ECConnectorRole", "ECFetchError", "ECItemLoad",
           "ECItemRef", "ECItemState", "ECLoadReport", "ECTransferParams", "done_future"]
