"""EngineCore: one scheduler + one model runner, stepped in a loop (token level, no text).

    step():  SchedulerOutput = scheduler.schedule()
             ModelRunnerOutput = runner.execute(SchedulerOutput)
             return scheduler.update(SchedulerOutput, ModelRunnerOutput)

KV connector: the engine never imports connectors/ (DESIGN.md section 2); the service hands it
either a factory `(role, engine_config) -> KVConnectorBase`, called once per role (scheduler
side here, worker side inside the runner), or one instance that implements both halves.

Executor: injected too (executor.py). The builder passes a factory, called once with the
config and the worker-side connector: a ModelRunner, or pdcluster.distributed's TPExecutor.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from pdcluster.config import EngineConfig
from pdcluster.engine.executor import ExecutorFactory
from pdcluster.engine.kv_connector import KVConnectorBase, KVConnectorRole
from pdcluster.engine.outputs import EngineCoreOutput
from pdcluster.engine.request import Request, RequestStatus

ConnectorFactory = Callable[[KVConnectorRole, EngineConfig], KVConnectorBase]
ConnectorArg = KVConnectorBase | ConnectorFactory | None
# An empty step (only transfers in flight) waits at most this long for a wake-up (a transfer
# ended, a command arrived) so the loop does not spin a core.
_IDLE_STEP_S = 0.001


def build_connectors(config: EngineConfig, connector: ConnectorArg) -> tuple[KVConnectorBase | None,
                                                                           KVConnectorBase | None]:
    """(scheduler side, worker side) from what the caller handed the engine."""
    if connector is None:
        if config.kv_connector:
            raise ValueError(
                f"kv_connector={config.kv_connector!r} is configured but no connector was given to the "
                "engine; pass connector=pdcluster.connectors.engine_connector_factory (the engine "
                "never imports connectors/ itself)")
        return None, None
    if isinstance(connector, KVConnectorBase):
        return connector, connector
    if callable(connector):
        return connector(KVConnectorRole.SCHEDULER, config), connector(KVConnectorRole.WORKER, config)
    raise TypeError(f"connector must be a KVConnectorBase or a factory, got {type(connector).__name__}")


class EngineCore:
    def __init__(self, config: EngineConfig, executor: ExecutorFactory,
                 connector: ConnectorArg = None) -> None:
        from pdcluster.engine.scheduler import Scheduler

        self.config = config
        sched_conn, worker_conn = build_connectors(config, connector)
        runner = executor(config, connector=worker_conn)
        self.runner = runner
        self._wake = threading.Event()
        if worker_conn is not None:
            worker_conn.set_wakeup(self.wake)
        self.scheduler = Scheduler(config.scheduler, config.cache, connector=sched_conn,
                                   sliding_window=config.model.kv_window, speculative=config.speculative)
        self.connector = sched_conn
        if sched_conn is not None and hasattr(runner, "handshake_metadata_all"):
            # Every TP rank's metadata, gathered by the executor; the scheduler side learns
            # addresses from here, never from request data.
            sched_conn.set_handshake_metadata(runner.handshake_metadata_all())
        elif sched_conn is not None and hasattr(runner, "handshake_metadata"):
            sched_conn.set_handshake_metadata({0: runner.handshake_metadata()})

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_stopped(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)

    def is_healthy(self) -> bool:
        """False once the runner can never step again (a TP rank died); a plain runner always is."""
        return self.health_error() is None

    def health_error(self) -> str | None:
        """Why the runner can never step again, or None while it can."""
        check = getattr(self.runner, "is_healthy", None)
        if check is None or check():
            return None
        return getattr(self.runner, "failure", None) or "the model runner is not running"

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def wake(self) -> None:
        """Cut an idle step's wait short (any thread): a transfer ended or a command arrived."""
        self._wake.set()

    def step(self) -> list[EngineCoreOutput]:
        self._wake.clear()  # a wake-up from here on ends this step's idle wait at once
        scheduler_output = self.scheduler.schedule()
        # The runner runs even on an empty step: it must drop state of finished requests and let a
        # connector make progress on asynchronous transfers.
        t0 = time.perf_counter()
        runner_output = self.runner.execute(scheduler_output)
        if scheduler_output.load_first:
            outputs = self.scheduler.update(scheduler_output, runner_output)
            return outputs + self._await_loads(scheduler_output.load_first)
        self.scheduler.record_step_time(scheduler_output, time.perf_counter() - t0)  # the draft policy's costs
        outputs = self.scheduler.update(scheduler_output, runner_output)
        progressed = (runner_output.finished_recving or runner_output.finished_sending
                      or runner_output.invalid_block_ids)
        if (scheduler_output.is_empty and not outputs and not progressed and self.connector is not None
                and self.scheduler.only_waiting()):
            # Only transfers in flight: wait for one to end (the connector's wake-up) or a
            # command, at most _IDLE_STEP_S, rather than spin. A step that collected a finished
            # transfer, or left something to deliver, goes on at once.
            self._wake.wait(_IDLE_STEP_S)
        return outputs

    def _await_loads(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        """After a load-first step (SchedulerConfig.kv_load_wait_s): wait for these loads to land,
        at most kv_load_wait_s, collecting each finished transfer with a step that computes
        nothing, so that the next step runs the loaded requests with the running ones.

        Why: a load started beside a step lands during it, and the request joined the step after
        next: its first decode waited for the rest of one step and all of another (traced on a
        1P+1D decode worker: RESULTS.md, session 28). On a worker whose cores the step fills, the
        load's copy takes them from that step anyway; what the running requests pay is the wait
        for the producer's answers."""
        deadline = time.monotonic() + self.scheduler.config.kv_load_wait_s
        outputs: list[EngineCoreOutput] = []
        while self.scheduler.loading_any(request_ids):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._wake.wait(left)  # the connector's wake-up when a transfer ends (or a command)
            self._wake.clear()
            idle = self.scheduler.schedule_idle()
            outputs += self.scheduler.update(idle, self.runner.execute(idle))
        return outputs

    def get_stats(self) -> dict[str, Any]:
        stats = self.scheduler.get_stats()
        if self.connector is not None:
            stats["kv_connector"] = _connector_stats(self.connector, self.runner)
        return stats

    def shutdown(self) -> None:
        """Stop the connector's worker side (transfer agents) and its scheduler side. Idempotent."""
        hooks = getattr(self.runner, "connector_hooks", None)
        shared = hooks is not None and hooks.connector is self.connector  # one object, both halves
        if hasattr(self.runner, "shutdown"):
            self.runner.shutdown()
        if self.connector is not None and not shared:
            self.connector.shutdown()
        self.connector = None


def _connector_stats(sched_conn: KVConnectorBase, runner: Any) -> dict[str, Any]:
    stats = dict(sched_conn.get_stats())
    hooks = getattr(runner, "connector_hooks", None)
    if hooks is not None and hooks.connector is not sched_conn:
        stats.update(hooks.connector.get_stats())
    return stats
