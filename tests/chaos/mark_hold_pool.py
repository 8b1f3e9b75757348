"""Worker processes for fault tests: `serve-worker` through mark_hold_cli.py (a "mig-" request
stops at each output mark until its worker is killed), as a WorkerPool the router harness
(tests/real_router_cluster.py) can take from, restart and stop by pid."""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Sequence

import grpc
from chaos.mark_hold import MARKS_ENV
from real_router_cluster import (
    WORKER_MAX_MODEL_LEN,
    WORKER_NUM_KV_BLOCKS,
    WorkerPool,
    WorkerProc,
    is_idle,
    wait_until,
    worker_stats,
)

MARK_HOLD_CLI = pathlib.Path(__file__).resolve().parent / "mark_hold_cli.py"


def _stats_of(address: str) -> str:
    """What keeps a worker busy, for a failure message."""
    try:
        s = worker_stats(address)
    except grpc.RpcError as e:
        return f"Stats failed: {e.code().name}"
    return (f"{s.num_running} running, {s.num_waiting} waiting, {s.num_kv_blocks_used} KV blocks used "
            f"of {s.num_kv_blocks_used + s.num_kv_blocks_free}")


class MarkHoldWorker(WorkerProc):
    cli = MARK_HOLD_CLI


class MarkHoldPool(WorkerPool):
    """Named workers, each `--role ROLE`; all hold "mig-" requests at `marks`."""

    def __init__(self, model: str, key_dir: str, log_dir: pathlib.Path, roles: Sequence[tuple[str, str]],
                 marks: Sequence[int], extra_args: Sequence[str] = (), env: dict[str, str] | None = None) -> None:
        self.args = ["--model", model, "--max-model-len", str(WORKER_MAX_MODEL_LEN), "--num-kv-blocks",
                     str(WORKER_NUM_KV_BLOCKS), "--key-dir", key_dir, "--log-level", "WARNING", *extra_args]
        self.log_dir = log_dir
        self.workers = []
        env = {**(env or {}), MARKS_ENV: ",".join(map(str, marks))}
        try:
            for name, role in roles:
                self.workers.append(MarkHoldWorker(name, ["--role", role, *self.args], log_dir, env=env))
            for w in self.workers:
                w.wait_ready()
        except BaseException:
            self.close()
            raise

    def take_named(self, names: Sequence[str], timeout: float = 120.0,
                   idle: Callable[[str], bool] = is_idle) -> list[WorkerProc]:
        """These workers, ready and idle (restarted first if a test killed them); `idle` asks a
        worker (by address) whether nothing runs there (mutual-TLS workers need a certificate)."""
        self.revive()
        chosen = [w for w in self.workers if w.name in names]
        for w in chosen:
            w.wait_ready(timeout)
            assert wait_until(lambda w=w: idle(w.address), 30), f"{w.name} is not idle: {_stats_of(w.address)}"
        return chosen
