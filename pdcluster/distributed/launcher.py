"""Start ranks 1..t-1 of a TP instance as child processes, watch them, and stop them.

Rank 0 is the engine's own process (it owns the scheduler and the service). Each other rank is
`python -m pdcluster.distributed.rank_main`, started with subprocess (not multiprocessing, whose
spawn pickles its arguments): its bootstrap (resolved config, rank, rendezvous port) is one
length-prefixed msgpack frame on its stdin.

Liveness, both directions, without polling:

    rank 0 -> child   the child's stdin pipe stays open; EOF means rank 0 is gone (exit, crash,
                      SIGKILL): the child exits at once, so no rank outlives its instance
    child  -> rank 0  one thread per child blocks in waitid(); an exit we did not ask for calls
                      on_death(rank, message), and the other children are killed (a half
                      instance can do nothing; killing them also breaks any collective rank 0
                      is blocked in, so the failing step returns promptly)
    stopped child     waitid also reports a child stopped by a signal (SIGSTOP, SIGTSTP): every
                      collective would block on it until the collective timeout while the worker
                      still looked healthy. Still stopped after STOPPED_GRACE_S (a Ctrl-Z of the
                      whole process group continues the children too, and is not a fault): it
                      is reported like a death and the instance is killed
"""

from __future__ import annotations

import logging
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

import msgpack

import pdcluster

log = logging.getLogger(__name__)
_FRAME = struct.Struct(">I")  # bootstrap frame length prefix
MAX_BOOTSTRAP_BYTES = 1 << 20
STOPPED_GRACE_S = 2.0


def write_frame(stream: IO[bytes], body: dict[str, Any]) -> None:
    data = msgpack.packb(body, use_bin_type=True)
    stream.write(_FRAME.pack(len(data)) + data)
    stream.flush()


def read_frame(stream: IO[bytes]) -> Any:
    from pdcluster.security.envelope import unpack_bounded

    head = stream.read(_FRAME.size)
    if len(head) != _FRAME.size:
        raise EOFError("no bootstrap frame on stdin")
    (n,) = _FRAME.unpack(head)
    if n > MAX_BOOTSTRAP_BYTES:
        raise ValueError(f"bootstrap frame of {n} bytes exceeds {MAX_BOOTSTRAP_BYTES}")
    return unpack_bounded(stream.read(n), MAX_BOOTSTRAP_BYTES)


def describe_exit(rank: int, pid: int, returncode: int) -> str:
    how = f"code {returncode}"
    if returncode < 0:
        try:
            how = f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            how = f"signal {-returncode}"
    return f"tensor-parallel rank {rank} (pid {pid}) exited with {how}; the instance is down"


class RankLauncher:
    def __init__(self, world_size: int, bootstrap: Callable[[int], dict[str, Any]],
                 on_death: Callable[[int, str], None], num_threads: int | None = None) -> None:
        self.world_size = world_size
        self._bootstrap = bootstrap
        self._on_death = on_death
        self._num_threads = num_threads
        self._procs: dict[int, subprocess.Popen] = {}
        self._lock = threading.Lock()
        self._stopping = False
        self._failed = False  # one report per instance: the first cause

    @property
    def pids(self) -> dict[int, int]:
        return {r: p.pid for r, p in self._procs.items()}

    def start(self) -> None:
        for rank in range(1, self.world_size):
            proc = subprocess.Popen(  # our own module, fixed argv
                [sys.executable, "-m", "pdcluster.distributed.rank_main"], stdin=subprocess.PIPE,
                stdout=2,  # rank logs go to stderr: stdout belongs to rank 0 (serve-worker's ready line)
                env=self._child_env(), close_fds=True)
            self._procs[rank] = proc
            assert proc.stdin is not None
            write_frame(proc.stdin, self._bootstrap(rank))
            threading.Thread(target=self._watch, args=(rank, proc), name=f"pdcluster-tp-watch-{rank}",
                             daemon=True).start()

    def _child_env(self) -> dict[str, str]:
        env = dict(os.environ)
        # The child imports pdcluster from the same tree as this process, installed or not.
        root = os.path.dirname(os.path.dirname(os.path.abspath(pdcluster.__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        if self._num_threads is not None and "PDCLUSTER_NUM_THREADS" not in env:
            env["PDCLUSTER_NUM_THREADS"] = str(self._num_threads)
        return env

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        watching = os.WEXITED | os.WSTOPPED | os.WCONTINUED | os.WNOWAIT  # NOWAIT: Popen reaps the exit
        while True:
            try:
                info = os.waitid(os.P_PID, proc.pid, watching)
            except ChildProcessError:  # reaped by Popen meanwhile (stop(), kill_all())
                break
            except InterruptedError:
                continue
            if info is None or info.si_code not in (os.CLD_STOPPED, os.CLD_CONTINUED):
                break
            # Consume the stop/continue report (not the exit: that stays for Popen.wait).
            os.waitid(os.P_PID, proc.pid, (os.WSTOPPED if info.si_code == os.CLD_STOPPED else os.WCONTINUED)
                      | os.WNOHANG)
            if info.si_code == os.CLD_STOPPED:
                timer = threading.Timer(STOPPED_GRACE_S, self._still_stopped, args=(rank, proc, info.si_status))
                timer.daemon = True
                timer.start()
        code = proc.wait()
        self._report(rank, describe_exit(rank, proc.pid, code))

    def _still_stopped(self, rank: int, proc: subprocess.Popen, signo: int) -> None:
        if proc.poll() is not None or _state(proc.pid) not in ("T", "t"):
            return  # continued (or gone: its watcher reports that)
        try:
            name = signal.Signals(signo).name
        except ValueError:
            name = f"signal {signo}"
        self._report(rank, f"tensor-parallel rank {rank} (pid {proc.pid}) stopped by {name} for over "
                           f"{STOPPED_GRACE_S:g}s; the instance is down")

    def _report(self, rank: int, msg: str) -> None:
        with self._lock:
            if self._stopping or self._failed:
                return
            self._failed = True
        log.error("%s", msg)
        self._on_death(rank, msg)
        self.kill_all()  # a stopped child dies of SIGKILL too; its watcher then returns quietly

    def kill_all(self) -> None:
        """SIGKILL every child still running (by pid, ours only)."""
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.kill()

    def alive(self) -> bool:
        return all(p.poll() is None for p in self._procs.values())

    def stop(self, timeout_s: float = 10.0, told_to_exit: bool = False) -> None:
        """Stop every child; idempotent. told_to_exit: they got the shutdown message, so give them
        timeout_s to exit on their own before their stdin closes (EOF makes a child exit at
        once, possibly before it read that message). Then wait, then kill stragglers."""
        with self._lock:
            self._stopping = True
        if told_to_exit:
            self._wait_all(timeout_s, kill=False)
        for proc in self._procs.values():
            try:
                if proc.stdin is not None:
                    proc.stdin.close()
            except OSError:
                pass
        self._wait_all(timeout_s, kill=True)

    def _wait_all(self, timeout_s: float, kill: bool) -> None:
        deadline = time.monotonic() + timeout_s
        for proc in self._procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                if kill:
                    log.warning("TP rank pid %d did not exit in %.0fs; killing it", proc.pid, timeout_s)
                    proc.kill()
                    proc.wait()


def _state(pid: int) -> str:
    """The process state letter from /proc (R, S, T stopped, t traced, Z ...), "" if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][:1]
    except (OSError, IndexError):
        return ""
