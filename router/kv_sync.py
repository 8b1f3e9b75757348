"""KVEventSync: subscribe to every worker's KV events and keep the prefix index current.

    registry (Stats poll) --endpoints, publisher key--> update() --add_publisher--> KVEventSubscriber
    event loop task: every kv_poll_interval_s  subscriber.poll(0)  (sync ZMQ, non-blocking)

The subscriber and the PrefixIndex are single-threaded by contract; both are only touched from
the router's event loop thread (here and in the routing policy), so no lock is needed.

Trust: endpoints come from the worker's own Stats over the channel the registry opened to an
address the operator configured. The publisher's CURVE server key must also be on the key
folder's allow-list: a worker that presents a key the cluster did not issue is refused and
counted, never subscribed to.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

import zmq

from pdcluster._proto import common_pb2
from pdcluster.security.keys import KeyMaterialError, KeyPair, normalize_public_key

from .kv_events import KVEventSubscriber
from .prefix_index import PrefixIndex

log = logging.getLogger(__name__)

_WILDCARD_HOSTS = ("0.0.0.0", "*", "[::]", "::")


def _endpoint_for(endpoint: str, worker_host: str) -> str:
    """A publisher bound to a wildcard address is reached at the worker's own host."""
    scheme, sep, rest = endpoint.partition("://")
    host, _, port = rest.rpartition(":")
    if sep and host in _WILDCARD_HOSTS:
        return f"{scheme}://{worker_host}:{port}"
    return endpoint


class KVEventSync:
    def __init__(self, keypair: KeyPair, index: PrefixIndex, *, allowed_publisher_keys: set[bytes] | None = None,
                 poll_interval_s: float = 0.01) -> None:
        self.index = index
        self.poll_interval_s = poll_interval_s
        self._allowed = allowed_publisher_keys
        self._ctx = zmq.Context()
        self.subscriber = KVEventSubscriber(self._ctx, keypair, index)
        self._subscribed: dict[str, tuple[str, str, bytes]] = {}
        self._refused: dict[str, tuple] = {}  # worker -> what was refused (count each offer once)
        self.refusals: Counter[str] = Counter()  # reason -> count (exported as a metric)
        self._task: asyncio.Task | None = None

    def update(self, worker_id: str, stats: common_pb2.WorkerStats, worker_host: str) -> None:
        """(Re)subscribe when a worker's KV-event endpoints or key changed; no-op otherwise."""
        if not (stats.kv_events_endpoint and stats.kv_snapshot_endpoint and stats.kv_events_public_key):
            return  # the worker publishes no KV events
        offer = (stats.kv_events_endpoint, stats.kv_snapshot_endpoint, stats.kv_events_public_key)
        if self._refused.get(worker_id) == offer:
            return
        try:
            key = normalize_public_key(stats.kv_events_public_key)
        except KeyMaterialError:
            self._refuse(worker_id, offer, "bad_publisher_key")
            return
        wanted = (_endpoint_for(stats.kv_events_endpoint, worker_host),
                  _endpoint_for(stats.kv_snapshot_endpoint, worker_host), key)
        if self._subscribed.get(worker_id) == wanted:
            return
        if self._allowed is not None and key not in self._allowed:
            self._refuse(worker_id, offer, "unknown_publisher_key")
            return
        try:
            self.subscriber.add_publisher(worker_id, *wanted)
        except (zmq.ZMQError, KeyMaterialError, ValueError) as e:
            self._refuse(worker_id, offer, "subscribe_failed", e)
            return
        self._refused.pop(worker_id, None)
        self._subscribed[worker_id] = wanted
        log.info("subscribed to KV events of %s at %s", worker_id, wanted[0])

    def _refuse(self, worker_id: str, offer: tuple, reason: str, err: BaseException | None = None) -> None:
        log.warning("not subscribing to KV events of %s: %s %s", worker_id, reason, err or "")
        self.refusals[reason] += 1
        self._refused[worker_id] = offer
        if self._subscribed.pop(worker_id, None) is not None:
            self.subscriber.remove_publisher(worker_id)

    def remove(self, worker_id: str) -> None:
        self._refused.pop(worker_id, None)
        self._subscribed.pop(worker_id, None)
        self.subscriber.remove_publisher(worker_id)  # also drops its blocks from the index

    @property
    def num_malformed(self) -> int:
        return self.subscriber.num_malformed

    def num_resyncs(self) -> dict[str, int]:
        out = {}
        for worker_id in self._subscribed:
            out[worker_id] = self.subscriber.tracker(worker_id).num_resyncs
        return out

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="pdcluster-kv-events")

    async def _run(self) -> None:
        while True:
            try:
                self.subscriber.poll(0)
            except Exception:  # a broken batch must not stop routing updates for good
                log.exception("KV event poll failed")
            await asyncio.sleep(self.poll_interval_s)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.subscriber.close()
        self._ctx.term()
