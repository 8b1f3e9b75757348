"""The executor EngineCore steps: the contract, and the default choice for a config.

EngineCore never builds its executor: whoever builds it (LLMEngine, a worker assembly, a test)
passes an `ExecutorFactory`, called once as `factory(config, connector=worker_side_connector)`.
`default_executor(config)` is what LLMEngine uses when it is handed none: a plain ModelRunner,
or with tensor_parallel_size > 1 the TP executor of pdcluster/distributed/. That one is named,
not imported (the Registry loads it on first use), because distributed/ is built on the engine:
it imports the runner and the step types from here, so the engine must not import it back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from pdcluster.config import EngineConfig
from pdcluster.engine.outputs import ModelRunnerOutput, SchedulerOutput
from pdcluster.registry import Registry

# Built-in executors by name: "module:attr" strings, so naming one imports nothing (no torch).
_BUILTIN_EXECUTORS = {
    "uniproc": "pdcluster.engine.model_runner:ModelRunner",
    "tp": "pdcluster.distributed.executor:TPExecutor",  # rank 0 in-process, ranks 1.. as children
    "encoder": "pdcluster.engine.encoder_runner:EncoderRunner",  # encoder_only: vision tower + projector
}


class Executor(Protocol):
    """What EngineCore.step() calls. Optional, looked up with getattr: shutdown(), is_healthy(),
    failure, handshake_metadata(), handshake_metadata_all(), connector_hooks."""

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


ExecutorFactory = Callable[..., Executor]  # (config, connector=worker-side connector | None)


def _callable(obj: object) -> ExecutorFactory:
    if not callable(obj):
        raise ValueError("not callable")
    return obj  # type: ignore[return-value]


def _build_registry() -> Registry[ExecutorFactory]:
    # Closed set: which executor runs is the engine's choice, not an operator's dotted path.
    registry: Registry[ExecutorFactory] = Registry("executor", check=_callable, allow_dotted=False)
    for name, path in _BUILTIN_EXECUTORS.items():
        registry.register(name, path)
    return registry


EXECUTORS = _build_registry()


def default_executor(config: EngineConfig) -> ExecutorFactory:
    """ModelRunner for one rank, the TP executor when tensor_parallel_size > 1, the EncoderRunner
    for an encoder_only engine."""
    if getattr(config, "encoder_only", False):
        return EXECUTORS.get("encoder")
    return EXECUTORS.get("tp" if config.parallel.tensor_parallel_size > 1 else "uniproc")


__all__ = ["EXECUTORS", "Executor", "ExecutorFactory", "default_executor"]
