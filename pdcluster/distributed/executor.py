"""TPExecutor: what EngineCore steps instead of a bare ModelRunner when tensor_parallel_size > 1.

It has the runner's interface (execute, shutdown) plus is_healthy and collective_stats, and
runs rank 0 in this process:

    EngineCore.step()                     rank 0 (this process)          ranks 1..t-1 (rank_main)
      step = scheduler.schedule()
      executor.execute(step) ---------->  broadcast(msgpack(step)) ----> decode(step)
                                          runner.execute(step)           runner.execute(step)
                                            all-reduce / all-gather <-->   all-reduce / all-gather
      scheduler.update(step, out) <-----  out (rank 0's sampled tokens)  (identical tokens, dropped)
                                          [with a KV connector]
                                          gather(report) <-------------- msgpack(finished/failed sets)
                                          completion counted over ranks

With a KV connector every rank builds its own worker-side connector (rank 0: the one the engine
handed us; ranks > 0: from the factory named in their start-up data, with the engine config's
kv_connector / kv_connector_options) and registers its own cache. The ranks' handshake metadata
is gathered to rank 0 once at start (handshake_metadata_all); the step's kv_connector_metadata
travels in the step broadcast (to_dict / the connector's metadata_from_dict); after each step
every rank's (finished_sending, finished_recving, failed blocks) is gathered to rank 0, so a
request is reported finished only when every rank finished it.

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

import msgpack
import torch

from pdcluster.config import EngineConfig
from pdcluster.distributed.config_codec import engine_config_to_dict
from pdcluster.distributed.errors import TPRankFailedError
from pdcluster.distributed.group import TPGroup, attach_tp_group, make_store
from pdcluster.distributed.launcher import RankLauncher
from pdcluster.distributed.step_codec import (
    MAX_CONTROL_MESSAGE_BYTES,
    decode_report,
    encode_report,
    encode_shutdown,
    encode_step,
)
from pdcluster.engine.outputs import ModelRunnerOutput, SchedulerOutput

log = logging.getLogger(__name__)
_HOST = "127.0.0.1"  # ranks of one instance share a host; the rendezvous never leaves loopback
# The factory a rank > 0 imports to build its worker-side connector (by name: the engine package
# never imports connectors/ statically).
DEFAULT_CONNECTOR_FACTORY = "pdcluster.connectors:engine_connector_factory"
MAX_REPORT_BYTES = 64 << 20
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
    def __init__(self, config: EngineConfig, connector: Any = None,
                 connector_factory: str = DEFAULT_CONNECTOR_FACTORY) -> None:
        if connector is not None:
            if not getattr(type(connector), "supports_tensor_parallel", lambda: False)():
                raise NotImplementedError(
                    f"KV connector {type(connector).__name__} does not support tensor_parallel_size > 1: "
                    "it must implement metadata_from_dict (its step metadata is broadcast to every rank)")
            if not config.kv_connector:
                raise ValueError("a KV connector with tensor_parallel_size > 1 needs engine_config.kv_connector "
                                 "(every rank builds its own worker side from the config)")
        self.connector = connector
        self._handshake_all: dict[int, Any] = {}
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
                "port": store.port, "timeout_s": self.timeout_s,
                "connector_factory": connector_factory if connector is not None else None}
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
        # CPU ranks share the cores this process may use (its affinity mask: a pinned worker's slice):
        # t processes with all of them each would oversubscribe.
        if self.config.device != "cpu" or os.environ.get("PDCLUSTER_NUM_THREADS"):
            return None
        return max(1, len(os.sched_getaffinity(0)) // self.world_size)

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
                runner = ModelRunner(self.config, rank=0, connector=self.connector)
                attach_tp_group(runner.model, group)
                group.barrier()
                if self.connector is not None:
                    mine = msgpack.packb(runner.handshake_metadata(), use_bin_type=True)
                    parts = group.gather_bytes(mine, MAX_REPORT_BYTES)
                    self._handshake_all = {r: msgpack.unpackb(b, raw=False) for r, b in enumerate(parts)}
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
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self._failure.message is not None:
            raise TPRankFailedError(self._failure.message)
        if self._closed:
            raise TPRankFailedError("the TP instance is shut down")
        try:
            t0 = time.perf_counter()
            self.group.broadcast_bytes(encode_step(scheduler_output), MAX_CONTROL_MESSAGE_BYTES)
            self.broadcast_s += time.perf_counter() - t0
            out = self.runner.execute(scheduler_output)
            hooks = self.runner.connector_hooks
            if hooks is not None:
                parts = self.group.gather_bytes(encode_report(*hooks.last_report), MAX_REPORT_BYTES)
                for rank, data in enumerate(parts[1:], start=1):
                    hooks.add_remote(rank, *decode_report(data, MAX_REPORT_BYTES))
                out = hooks.merge_completed(out)
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

    def handshake_metadata(self) -> Any:
        """Rank 0's connector handshake metadata (None without a connector)."""
        return self.runner.handshake_metadata()

    def handshake_metadata_all(self) -> dict[int, Any]:
        """rank -> that rank's connector handshake metadata (empty without a connector)."""
        return dict(self._handshake_all)

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
