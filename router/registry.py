"""WorkerRegistry: the router's workers, their health, load and static facts.

One probe task per worker, every health_interval_s:

    health Check --SERVING--> GetInfo (first contact or after an ejection: it may have restarted)
                              Stats   (load for the policies, KV-event endpoints for kv_sync)
                --anything else--> a failure for its CircuitBreaker

The orchestrator reports request outcomes too: a failed RPC ejects the worker at once. Workers
the breaker keeps OPEN are not offered to the policies; a SERVING check re-admits them.
Everything here runs on the router's event loop (no locks); policies read views built per pick.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import grpc

from pdcluster._proto import common_pb2, worker_pb2

from .circuit_breaker import CircuitBreaker
from .config import RouterConfig
from .kv_sync import KVEventSync
from .policies import WorkerStats, WorkerView
from .tls_reload import ChannelRebuilder
from .worker_client import WorkerClient

log = logging.getLogger(__name__)

ROLE_NAMES = {
    common_pb2.WORKER_ROLE_PREFILL: "prefill",
    common_pb2.WORKER_ROLE_DECODE: "decode",
    common_pb2.WORKER_ROLE_BOTH: "both",
    common_pb2.WORKER_ROLE_ENCODE: "encode",
}


@dataclass(eq=False)
class WorkerHandle:
    address: str
    client: WorkerClient
    breaker: CircuitBreaker
    info: worker_pb2.WorkerInfo | None = None
    stats: common_pb2.WorkerStats | None = None
    stats_at: float = 0.0  # monotonic time of the last Stats answer
    num_inflight: int = 0  # requests this router has on the worker and not seen finish
    # Prompt tokens of this router's legs that compute a prompt on the worker, from the call until
    # the leg's first response (LegRunner; read by disagg_rule.py).
    prefill_backlog: int = 0
    task: asyncio.Task | None = field(default=None, repr=False)
    tls_stamp: object = None  # the TLS files `client` was built from (tls_reload.py)

    @property
    def worker_id(self) -> str:
        # The worker's own id when known: KV events and the prefix index are keyed by it.
        return self.info.worker_id if self.info is not None and self.info.worker_id else self.address

    @property
    def role(self) -> str:
        return ROLE_NAMES.get(self.info.role, "both") if self.info is not None else "unknown"

    @property
    def healthy(self) -> bool:
        return self.info is not None and self.breaker.allows_traffic

    @property
    def host(self) -> str:
        return self.address.rpartition(":")[0].strip("[]")

    def view(self) -> WorkerView:
        return WorkerView(self.worker_id, self.address, self.role, self.healthy)

    def load(self) -> WorkerStats:
        s = self.stats
        if s is None:
            return WorkerStats(num_inflight=self.num_inflight)
        return WorkerStats(s.num_running, s.num_waiting, s.kv_usage, self.num_inflight)


class WorkerRegistry:
    def __init__(self, config: RouterConfig, *, kv_sync: KVEventSync | None = None,
                 on_change: Callable[[], None] | None = None) -> None:
        self.config = config
        self.kv_sync = kv_sync
        self._on_change = on_change
        self._handles: dict[str, WorkerHandle] = {}
        self._started = False
        self._changed = asyncio.Event()
        # Worker channels follow the router's TLS files (rotation without restart).
        self._tls = ChannelRebuilder(config.worker_tls, self._client, config.request_timeout_s)

    # -- membership -----------------------------------------------------------------------------
    def add(self, address: str) -> WorkerHandle:
        """Register a worker (idempotent); it takes traffic after its first SERVING check."""
        if address in self._handles:
            return self._handles[address]
        handle = WorkerHandle(address, self._client(address), CircuitBreaker(self.config.eject_after_failures),
                              tls_stamp=self._tls.current())
        self._handles[address] = handle
        if self._started:
            self._start_probe(handle)
        return handle

    def _client(self, address: str) -> WorkerClient:
        return WorkerClient(address, max_message_bytes=self.config.max_message_bytes, tls=self.config.worker_tls,
                            multiplex=self.config.worker_channel == "stream")

    async def remove(self, address: str) -> None:
        handle = self._handles.pop(address, None)
        if handle is None:
            return
        if handle.task is not None:
            handle.task.cancel()
            await asyncio.gather(handle.task, return_exceptions=True)
        if self.kv_sync is not None:
            self.kv_sync.remove(handle.worker_id)
        await handle.client.close()
        self._notify()

    async def start(self) -> None:
        self._started = True
        for address in self.config.workers:
            self.add(address)
        for handle in self._handles.values():
            if handle.task is None:
                self._start_probe(handle)

    async def stop(self) -> None:
        for address in list(self._handles):
            await self.remove(address)
        await self._tls.close()
        self._started = False

    # -- queries --------------------------------------------------------------------------------
    @property
    def handles(self) -> list[WorkerHandle]:
        return list(self._handles.values())

    def get(self, address: str) -> WorkerHandle | None:
        return self._handles.get(address)

    def candidates(self, roles: Iterable[str]) -> list[WorkerHandle]:
        """Workers with one of `roles` that the breaker lets traffic through to."""
        return [h for h in self._handles.values() if h.healthy and h.role in roles]

    @property
    def num_healthy(self) -> int:
        return sum(h.healthy for h in self._handles.values())

    def first_info(self) -> worker_pb2.WorkerInfo | None:
        return next((h.info for h in self._handles.values() if h.info is not None), None)

    async def wait_for_healthy(self, count: int = 1, timeout_s: float | None = None) -> bool:
        """Wait until at least `count` workers are healthy; False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.num_healthy < count:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                return self.num_healthy >= count
        return True

    # -- outcomes reported by the orchestrator --------------------------------------------------
    def report_success(self, handle: WorkerHandle) -> None:
        was = handle.breaker.state
        handle.breaker.record_success()
        if handle.breaker.state != was:
            self._notify()

    def report_failure(self, handle: WorkerHandle, *, fatal: bool, reason: str = "") -> None:
        if handle.breaker.record_failure(fatal=fatal):
            log.warning("ejected worker %s (%s): %s", handle.worker_id, handle.address, reason or "failures")
            self._notify()

    # -- probing --------------------------------------------------------------------------------
    def _start_probe(self, handle: WorkerHandle) -> None:
        handle.task = asyncio.get_running_loop().create_task(self._probe_loop(handle), name=f"probe-{handle.address}")

    async def _probe_loop(self, handle: WorkerHandle) -> None:
        while True:
            try:
                await self.probe(handle)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not stop probing (the worker would stay ejected)
                log.exception("probe of %s failed", handle.address)
            await asyncio.sleep(self.config.health_interval_s)

    async def probe(self, handle: WorkerHandle) -> None:
        """One health check (+ GetInfo + Stats when SERVING); updates the breaker."""
        timeout = self.config.health_timeout_s
        self._tls.rebuild_if_changed(handle)
        serving = await handle.client.check_health(timeout)
        if serving:
            serving = await self._refresh(handle, timeout)
        was_healthy = handle.healthy
        if handle.breaker.record_health(serving):
            log.info("worker %s (%s) is serving%s", handle.worker_id, handle.address,
                     " again" if handle.breaker.num_ejections else "")
        if handle.healthy != was_healthy:
            self._notify()

    async def _refresh(self, handle: WorkerHandle, timeout: float) -> bool:
        try:
            if handle.info is None or not handle.breaker.allows_traffic:
                # After an ejection the worker may be a new incarnation: re-read its facts.
                info = await handle.client.info(timeout)
                if handle.info is not None and info.engine_epoch != handle.info.engine_epoch:
                    log.info("worker %s restarted (epoch %d -> %d)", handle.address,
                             handle.info.engine_epoch, info.engine_epoch)
                    if self.kv_sync is not None and handle.info.worker_id != info.worker_id:
                        self.kv_sync.remove(handle.worker_id)
                handle.info = info
            stats = await handle.client.stats(timeout)
        except grpc.aio.AioRpcError as e:
            log.debug("worker %s: %s", handle.address, e.code().name)
            return False
        handle.stats, handle.stats_at = stats, time.monotonic()
        if self.kv_sync is not None:
            self.kv_sync.update(handle.worker_id, stats, handle.host)
        return True

    def _notify(self) -> None:
        self._changed.set()
        if self._on_change is not None:
            self._on_change()
