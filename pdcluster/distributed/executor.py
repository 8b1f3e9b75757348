"""TPExecutor: what EngineCore steps instead of a bare ModelRunner when tensor_parallel_size > 1.

It has the runner's interface (execute, shutdown) plus is_healthy and collective_stats, and
runs rank 0 in this process:

    EngineCore.step()                     rank 0 (this process)          ranks 1..t-1 (rank_main)
      so = scheduler.schedule()
      executor.execute(so) ------------>  broadcast(msgpack(so)) ------> decode(so)
                                          runner.execute(so)             runner.execute(so)
                                            all-reduce / all-gather <-->   all-reduce / all-gather
      scheduler.update(so, out) <-------  out (rank 0's sampled tokens)  (identical tokens, dropped)

Every rank samples: after the LM head's all-gather all ranks hold bit-identical logits, and the
samplers share the seed, so each rank's copy of the request state stays in step without a
second message. Any failure inside a step is fatal for the instance (rank states may have
diverged): the executor kills its children and raises TPRankFailedError from then on.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import Any, NoReturn

import torch

from pdcluster.config import EngineConfig
from pdcluster.distributed.config_codec import engine_config_to_dict
from pdcluster.distributed.errors import TPRankFailedError
from pdcluster.distributed.group import TPGroup, attach_tp_group, make_store
from pdcluster.distributed.launcher import RankLauncher
from pdcluster.distributed.step_codec import MAX_CONTROL_MESSAGE_BYTES, encode_shutdown, encode_step
from pdcluster.engine.outputs import ModelRunnerOutput, SchedulerOutput

log = logging.getLogger(__name__)
_HOST = "127.0.0.1"  # ranks of one instance share a host; the rendezvous never leaves loopback
# After a failed collective, how long to wait for the liveness watcher to name the dead rank.
_DEATH_REPORT_WAIT_S = 2.0


class _Failure:
    """The first fatal error of the instance, set from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.message: str | None = None
        self.event = threading.Event()

    def set(self, message: str) -> None:
        with self._lock:
            if self.message is None:
                self.message = message
        self.event.set()


class TPExecutor:
    def __init__(self, config: EngineConfig, connector: Any = None) -> None:
        if connector is not None:
            raise NotImplementedError(
                "a KV connector with tensor_parallel_size > 1 is not supported yet: every rank needs its "
                "own worker-side connector and the step metadata its own wire format")
        self.config = config
        self.world_size = config.parallel.tensor_parallel_size
        self.timeout_s = config.parallel.collective_timeout_s
        self._failure = _Failure()
        self._closed = False
        self.num_steps = 0
        self.broadcast_s = 0.0
        self._prev_threads = torch.get_num_threads()
        threads = self._threads_per_rank()
        store = make_store(_HOST, 0, self.world_size, True, self.timeout_s)
        boot = {"config": engine_config_to_dict(config), "world_size": self.world_size, "host": _HOST,
                "port": store.port, "timeout_s": self.timeout_s}
        failure = self._failure
        # The callbacks must not reference self: the finalizer below holds the launcher, and a
        # path back to self would keep the executor alive until interpreter exit.
        self.launcher = RankLauncher(self.world_size, lambda rank: {**boot, "rank": rank},
                                     lambda _rank, msg: failure.set(msg), num_threads=threads)
        # Children die with us even if nobody calls shutdown() (an LLM dropped without it).
        self._finalizer = weakref.finalize(self, _reap, self.launcher)
        self.launcher.start()
        try:
            self.group, self.runner = self._init_rank0(store, threads)
        except BaseException:
            self._finalizer()
            raise
        self._store = store  # the TCPStore server lives as long as the instance

    def _threads_per_rank(self) -> int | None:
        # CPU ranks share the host's cores: t processes with all cores each would oversubscribe.
        if self.config.device != "cpu" or os.environ.get("PDCLUSTER_NUM_THREADS"):
            return None
        return max(1, (os.cpu_count() or 1) // self.world_size)

    def _init_rank0(self, store: Any, threads: int | None) -> tuple[TPGroup, Any]:
        """Rendezvous, load rank 0's shard, and wait until every rank loaded its own. Runs in a
        helper thread so a child that dies before the rendezvous fails us now, not at timeout."""
        result: dict[str, Any] = {}

        def init() -> None:
            try:
                from pdcluster.engine.model_runner import ModelRunner

                if threads is not None:
                    torch.set_num_threads(threads)
                group = TPGroup(store, 0, self.world_size, self.config.device, self.timeout_s)
                runner = ModelRunner(self.config, rank=0)
                attach_tp_group(runner.model, group)
                group.barrier()
                result["ok"] = (group, runner)
            except BaseException as e:
                result["error"] = e

        t = threading.Thread(target=init, name="pdcluster-tp-init", daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.1)
            if self._failure.event.is_set():
                raise TPRankFailedError(f"TP instance failed to start: {self._failure.message}")
        if "error" in result:
            raise TPRankFailedError(f"TP instance failed to start: {result['error']!r}") from result["error"]
        return result["ok"]

    # -- runner interface -------------------------------------------------------------------------
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if self._failure.message is not None:
            raise TPRankFailedError(self._failure.message)
        if self._closed:
            raise TPRankFailedError("the TP instance is shut down")
        try:
            t0 = time.perf_counter()
            self.group.broadcast_bytes(encode_step(so), MAX_CONTROL_MESSAGE_BYTES)
            self.broadcast_s += time.perf_counter() - t0
            out = self.runner.execute(so)
        except Exception as e:
            self._fail(e)
        self.num_steps += 1
        return out

    def _fail(self, e: BaseException) -> NoReturn:
        # Prefer the watcher's precise report ("rank 1 (pid ..) exited with signal SIGKILL").
        if not self._failure.event.wait(_DEATH_REPORT_WAIT_S):
            self._failure.set(f"tensor-parallel step failed on rank 0: {e!r}; the instance is down")
        self.launcher.kill_all()
        raise TPRankFailedError(self._failure.message) from e

    def is_healthy(self) -> bool:
        return self._failure.message is None and not self._closed and self.launcher.alive()

    @property
    def failure(self) -> str | None:
        return self._failure.message

    def collective_stats(self) -> dict[str, float]:
        """Rank 0's counters: model collectives (count, seconds, bytes), step broadcasts, steps."""
        return {**self.group.stats.as_dict(), "broadcast_s": self.broadcast_s, "num_steps": self.num_steps}

    @property
    def pids(self) -> dict[int, int]:
        return self.launcher.pids

    def shutdown(self) -> None:
        """Tell the ranks to exit, wait for them (kill after a bound), release everything."""
        if self._closed:
            return
        self._closed = True
        told = False
        if self._failure.message is None and self.launcher.alive():
            try:
                self.group.broadcast_bytes(encode_shutdown(), MAX_CONTROL_MESSAGE_BYTES)
                told = True
            except Exception as e:  # a rank died meanwhile: stop() kills what is left
                log.warning("shutdown broadcast failed: %r", e)
        self.runner.shutdown()
        self.launcher.stop(told_to_exit=told)
        self.group.shutdown()
        self._finalizer.detach()
        if self._threads_per_rank() is not None:
            torch.set_num_threads(self._prev_threads)


def _reap(launcher: RankLauncher) -> None:
    launcher.stop(timeout_s=2.0)
