"""LocalLauncher: start worker processes on this machine, wait until each is serving, stop them all.

    launcher = LocalLauncher()
    workers = launcher.start([WorkerSpec("worker-0", ["--role", "both", ...]), ...])  # PDCLUSTER_READY each
    ...
    launcher.stop()   # SIGTERM every child by pid, SIGKILL what is left after the grace period

Guarantees:
- Every child is stopped by its own pid -- never by name -- and waited for (no zombies).
- A child that does not print its `PDCLUSTER_READY {json}` line within the timeout, or exits first,
  fails start() with a report naming each worker that did not come up, its exit status and the
  tail of its log; the others are stopped too.
- No orphans: on Linux each child gets PR_SET_PDEATHSIG=SIGTERM, so even a launcher killed with
  SIGKILL takes its workers with it. Children run in their own session, so a terminal's Ctrl-C
  reaches only the launcher, which then stops them in order.
Call start() from a long-lived thread (the main thread): PDEATHSIG fires when the *thread* that
forked exits.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

READY_PREFIX = "PDCLUSTER_READY "
SERVE_WORKER_ARGV = (sys.executable, "-m", "pdcluster.cluster.cli", "serve-worker")
_PR_SET_PDEATHSIG = 1


class LaunchError(RuntimeError):
    """Some workers did not come up; the message says which and why."""


@dataclass(frozen=True)
class WorkerSpec:
    name: str
    args: Sequence[str]  # appended to the launcher's worker argv
    env: Mapping[str, str] = field(default_factory=dict)  # over the launcher's environment, this worker only


@dataclass
class LaunchedProcess:
    name: str
    proc: subprocess.Popen
    ready: dict = field(default_factory=dict)
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=40))
    reported_exit: bool = False
    readers: list[threading.Thread] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def address(self) -> str:
        return str(self.ready.get("address", ""))

    def summary(self) -> dict[str, object]:
        """This instance in a launcher's ready line: role, address, pid and its metrics URL."""
        return {"role": self.ready.get("role", ""), "address": self.address, "pid": self.pid,
                "pids": [self.pid], "metrics": self.ready.get("metrics", "")}

    def status(self) -> str:
        code = self.proc.poll()
        if code is None:
            return "still running, no PDCLUSTER_READY line yet"
        return f"exited with {code}" if code >= 0 else f"killed by signal {-code}"


def _set_pdeathsig() -> None:  # runs in the child between fork and exec
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


class LocalLauncher:
    def __init__(self, *, worker_argv: Sequence[str] = SERVE_WORKER_ARGV, env: Mapping[str, str] | None = None,
                 ready_timeout_s: float = 300.0, grace_s: float = 10.0, echo_logs: bool = True) -> None:
        self.worker_argv = list(worker_argv)
        self.env = {**os.environ, **(env or {})}
        self.ready_timeout_s = ready_timeout_s
        self.grace_s = grace_s
        self.echo_logs = echo_logs
        self.processes: list[LaunchedProcess] = []
        self._ready: queue.SimpleQueue[tuple[LaunchedProcess, dict | None]] = queue.SimpleQueue()

    # -- start ----------------------------------------------------------------------------------
    def start(self, specs: Sequence[WorkerSpec]) -> list[LaunchedProcess]:
        """Start every worker at once (they load in parallel) and wait for all to be ready."""
        launched = [self._spawn(spec) for spec in specs]
        # Reader threads only after every fork: forking while other threads run is what makes
        # preexec_fn unsafe.
        for p in launched:
            self._start_readers(p)
        try:
            self._wait_ready(launched)
        except BaseException:
            self.stop()
            raise
        return launched

    def _spawn(self, spec: WorkerSpec) -> LaunchedProcess:
        argv = [*self.worker_argv, *spec.args]
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env={**self.env, **spec.env} if spec.env else self.env, start_new_session=True,
                                preexec_fn=_set_pdeathsig if sys.platform == "linux" else None)
        p = LaunchedProcess(spec.name, proc)
        self.processes.append(p)
        log.info("started %s (pid %d): %s", spec.name, proc.pid, " ".join(argv))
        return p

    def _start_readers(self, p: LaunchedProcess) -> None:
        def read_stdout() -> None:
            assert p.proc.stdout is not None
            announced = False
            for line in p.proc.stdout:
                if not announced and line.startswith(READY_PREFIX.encode()):
                    try:
                        self._ready.put((p, json.loads(line[len(READY_PREFIX):])))
                        announced = True
                        continue
                    except ValueError:
                        pass
                self._log_line(p, line)
            if not announced:
                self._ready.put((p, None))  # exited (or closed stdout) without a ready line

        def read_stderr() -> None:
            assert p.proc.stderr is not None
            for line in p.proc.stderr:
                self._log_line(p, line)

        for target in (read_stdout, read_stderr):
            t = threading.Thread(target=target, name=f"{p.name}-{target.__name__}", daemon=True)
            t.start()
            p.readers.append(t)

    def _log_line(self, p: LaunchedProcess, line: bytes) -> None:
        text = line.decode(errors="replace").rstrip("\n")
        p.tail.append(text)
        if self.echo_logs:
            sys.stderr.write(f"[{p.name}] {text}\n")

    def _wait_ready(self, launched: list[LaunchedProcess]) -> None:
        pending = {id(p): p for p in launched}
        failed: list[LaunchedProcess] = []
        deadline = time.monotonic() + self.ready_timeout_s
        while pending and not failed:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                p, ready = self._ready.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                continue
            if id(p) not in pending:
                continue
            del pending[id(p)]
            if ready is None:
                p.proc.wait(5)  # stdout closed: it is exiting; get its status for the report
                failed.append(p)
            else:
                p.ready = ready
                log.info("%s ready at %s (pid %d)", p.name, p.address, p.pid)
        if failed or pending:
            not_up = failed + list(pending.values())
            why = "" if failed else f" within {self.ready_timeout_s:g}s"
            report = "\n".join(f"  {p.name} (pid {p.pid}): {p.status()}\n    " + "\n    ".join(list(p.tail)[-15:])
                               for p in not_up)
            raise LaunchError(f"{len(not_up)} of {len(launched)} workers did not come up{why}:\n{report}")

    # -- watch and stop -------------------------------------------------------------------------
    def newly_exited(self) -> list[LaunchedProcess]:
        """Children that exited since the last call (for the foreground loop to report)."""
        out = []
        for p in self.processes:
            if not p.reported_exit and p.proc.poll() is not None:
                p.reported_exit = True
                out.append(p)
        return out

    def stop(self) -> None:
        """SIGTERM every child, wait up to grace_s in total, SIGKILL the rest, reap all."""
        alive = [p for p in self.processes if p.proc.poll() is None]
        for p in alive:
            _signal(p, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for p in alive:
            try:
                p.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) ignored SIGTERM for %gs: killing it", p.name, p.pid, self.grace_s)
                _signal(p, signal.SIGKILL)
                p.proc.wait()
        for p in self.processes:
            p.proc.wait()  # reaps the ones that had already exited (all are dead by now)
            for t in p.readers:
                t.join(1.0)  # EOF follows the exit, unless a grandchild still holds the pipe
            if not any(t.is_alive() for t in p.readers):
                for stream in (p.proc.stdout, p.proc.stderr):
                    if stream is not None:
                        stream.close()
        self.processes = [p for p in self.processes if p.proc.returncode is None]

    def __enter__(self) -> LocalLauncher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal(p: LaunchedProcess, sig: int) -> None:
    try:
        os.kill(p.pid, sig)  # by pid: the one process we started, nothing else
    except ProcessLookupError:
        pass
