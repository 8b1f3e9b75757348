"""grpc.health.v1 for a worker: SERVING while the engine thread is alive, NOT_SERVING after it
died, once a drain or shutdown began (so routers stop sending before the port closes).

Both the overall status ("") and the service name "pdcluster.v1.Worker" are reported.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from grpc_health.v1 import health, health_pb2

if TYPE_CHECKING:
    from pdcluster.engine.async_engine import AsyncEngine

log = logging.getLogger(__name__)

WORKER_SERVICE_NAME = "pdcluster.v1.Worker"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class EngineHealth:
    def __init__(self, engine: AsyncEngine, service_name: str = WORKER_SERVICE_NAME,
                 interval_s: float = 0.25) -> None:
        """Only engine.is_healthy is read."""
        self.engine = engine
        self.service_name = service_name
        self.interval_s = interval_s
        self.servicer = health.aio.HealthServicer()
        self._status: int | None = None
        self._task: asyncio.Task | None = None
        self._draining = False

    async def start(self) -> None:
        await self._refresh()
        self._task = asyncio.get_running_loop().create_task(self._watch(), name="pdcluster-health")

    async def _refresh(self) -> None:
        status = SERVING if self.engine.is_healthy and not self._draining else NOT_SERVING
        if status != self._status:
            if status == NOT_SERVING and self._status is not None and not self._draining:
                log.error("engine is not healthy; health status -> NOT_SERVING")
            self._status = status
            for name in ("", self.service_name):
                await self.servicer.set(name, status)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self._refresh()

    async def drain(self) -> None:
        """NOT_SERVING from now on (routers stop sending); Check calls are still answered."""
        self._draining = True
        await self._refresh()

    async def shutdown(self) -> None:
        """NOT_SERVING from now on, for every service, also for later Check calls."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        await self.servicer.enter_graceful_shutdown()
