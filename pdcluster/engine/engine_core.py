"""EngineCore: one scheduler + one model runner, stepped in a loop (token level, no text).

    step():  SchedulerOutput = scheduler.schedule()
             ModelRunnerOutput = runner.execute(SchedulerOutput)
             return scheduler.update(SchedulerOutput, ModelRunnerOutput)
"""

from __future__ import annotations

from typing import Any

from pdcluster.config import EngineConfig
from pdcluster.engine.outputs import EngineCoreOutput
from pdcluster.engine.request import Request, RequestStatus


class EngineCore:
    def __init__(self, config: EngineConfig, connector: Any = None, runner: Any = None) -> None:
        from pdcluster.engine.scheduler import Scheduler

        self.config = config
        if runner is None:
            from pdcluster.engine.model_runner import ModelRunner

            runner = ModelRunner(config)
        self.runner = runner
        self.scheduler = Scheduler(config.scheduler, config.cache, connector=connector)
        self.connector = connector

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_stopped(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        scheduler_output = self.scheduler.schedule()
        # The runner runs even on an empty step: it must drop state of finished requests and let a
        # connector make progress on asynchronous transfers.
        runner_output = self.runner.execute(scheduler_output)
        return self.scheduler.update(scheduler_output, runner_output)

    def get_stats(self) -> dict[str, Any]:
        return self.scheduler.get_stats()
