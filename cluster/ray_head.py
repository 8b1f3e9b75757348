"""A local Ray head that `pdcluster up` starts (and `down` stops), and the state file that lets a
later `status`/`down` find it.

The head runs as `ray start --head --block`: on SIGTERM that process stops every Ray process it
started (raylet, GCS, dashboard, workers), so stopping the cluster is one signal to one pid we
recorded, never `ray stop` (which stops every Ray cluster of the machine, by name).
- foreground `up`: the head gets PDEATHSIG, so it dies with the launcher even on SIGKILL;
- `up --detach`: the head has its own session and log file and outlives the launcher.

State file: $PDCLUSTER_STATE_DIR (default ~/.local/state/pdcluster)/NAMESPACE.json, mode 0600.
It holds addresses and pids, never keys.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# Runs in the child before exec: PDEATHSIG survives exec, and the ppid check closes the window
# in which the parent died before prctl. No preexec_fn: forking a threaded process (a Ray actor)
# and running Python between fork and exec can deadlock.
_PDEATHSIG_SHIM = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"  # 1 = PR_SET_PDEATHSIG
    "os.getppid() == int(sys.argv[1]) or sys.exit(70)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)
RAY_CLI = (sys.executable, "-m", "ray.scripts.scripts")
# The head prints how to join it once it serves: "ray start --address='10.0.0.5:6379'".
_ADDRESS_RE = re.compile(r"ray start --address='([^']+)'")
_BLOCKING = "will now block forever"  # `ray start --block` once every process of the head runs


def token_auth_env() -> dict[str, str]:
    """The environment that makes a Ray process use token authentication (Ray's own access
    control: a cluster without it runs code for anyone who reaches its ports)."""
    return {"RAY_AUTH_MODE": "token"}


def ensure_auth_token() -> None:
    """Makes the user's token (~/.ray/auth_token, mode 0600) when there is none; its value never
    passes through us. Ray is told what to do through the child's environment, never ours."""
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return
    if not (pathlib.Path.home() / ".ray" / "auth_token").is_file():
        subprocess.run([*RAY_CLI, "get-auth-token", "--generate"], check=True, stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **token_auth_env()})


@contextlib.contextmanager
def driver_env(env: Mapping[str, str]) -> Iterator[None]:
    """env in os.environ only while this process imports ray and runs ray.init, then what was
    there before. Ray reads these settings only there (at import, and RAY_AUTH_MODE again when its
    config is refreshed) and keeps them for its connection, so the caller's environment -- and
    every process it starts later, a test's next Ray cluster included -- stays as it was."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    if "ray._raylet" in sys.modules:  # Ray caches its config at import: refresh it, as Ray itself does
        sys.modules["ray._raylet"].Config.initialize("")
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def with_pdeathsig(argv: Sequence[str]) -> list[str]:
    """argv wrapped so the process gets SIGTERM when the calling thread's process dies (Linux);
    argv[0] must be an executable path. The exec'd program keeps the shim's pid."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-c", _PDEATHSIG_SHIM, str(os.getpid()), *argv]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class LocalHead:
    pid: int
    address: str      # GCS address for ray.init
    log_path: str
    start_time: float  # the process's start (from /proc): guards a recycled pid in `down`
    # What a driver of this head needs while it imports ray and joins (driver_env): token
    # authentication and the loopback node.
    env: Mapping[str, str] = field(default_factory=dict)


def loopback_env() -> dict[str, str]:
    """The environment that keeps a one-machine Ray on loopback. Ray replaces a loopback
    --node-ip-address with the machine's routable IP unless its single-machine mode is on (the
    macOS/Windows default, off on Linux); in that mode the node IP is 127.0.0.1 and every Ray
    server -- GCS, raylet, dashboard and its agent, runtime-env agent, Ray Client server, the
    workers' own gRPC servers -- binds it instead of the node IP or all interfaces."""
    return {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def use_loopback_node() -> None:
    """This process (the driver) joins a loopback head as 127.0.0.1 too: otherwise ray.init
    looks for a raylet on the machine's routable IP and waits for one forever. Before `import
    ray`, which reads the setting at import (and Ray's core worker again later, so it stays
    set for the process: unlike RAY_AUTH_MODE it cannot be scoped to ray.init)."""
    _check_ray_not_imported()
    os.environ.update(loopback_env())


def _check_ray_not_imported() -> None:
    if "ray._private.ray_constants" in sys.modules:
        raise RuntimeError("ray was imported before the loopback head was set up")


def start_local_head(*, num_cpus: int | None, resources: Mapping[str, float], labels: Mapping[str, str],
                     log_path: pathlib.Path, detach: bool, dashboard: bool = True,
                     timeout_s: float = 120.0) -> LocalHead:
    """Start `ray start --head --block` bound to loopback and wait until it serves."""
    port, dash_port = free_port(), free_port()
    # For the process, as before: Ray's core worker resolves the node IP from this setting after
    # ray.init too (a driver that saw it only during ray.init dials the routable IP).
    use_loopback_node()
    ensure_auth_token()
    env = {**token_auth_env(), **loopback_env()}
    argv = [*RAY_CLI, "start", "--head", "--block", f"--port={port}", "--disable-usage-stats",
            "--node-ip-address=127.0.0.1"]
    argv += [f"--include-dashboard={dashboard}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash_port}"]
    if num_cpus is not None:
        argv.append(f"--num-cpus={num_cpus}")
    if resources:
        argv.append(f"--resources={json.dumps(dict(resources))}")
    if labels:
        argv.append("--labels=" + ",".join(f"{k}={v}" for k, v in labels.items()))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:  # a file, not a pipe: a detached head must outlive us
        proc = subprocess.Popen(argv if detach else with_pdeathsig(argv), stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **env})
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the local Ray head exited with {proc.returncode}:\n{_tail(log_path)}")
        text = log_path.read_text(errors="replace")
        m = _ADDRESS_RE.search(text)  # a head on a routable IP prints how to join it
        if m:
            return LocalHead(proc.pid, m.group(1), str(log_path), process_start_time(proc.pid), env)
        if _BLOCKING in text:  # a loopback head prints no join line: its address is ours
            return LocalHead(proc.pid, f"127.0.0.1:{port}", str(log_path), process_start_time(proc.pid), env)
        time.sleep(0.2)
    stop_local_head(proc.pid, grace_s=5.0)
    raise RuntimeError(f"the local Ray head did not start within {timeout_s:g}s:\n{_tail(log_path)}")


def _tail(path: pathlib.Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def process_start_time(pid: int) -> float:
    """Start time of pid in clock ticks since boot (field 22 of /proc/PID/stat); 0 if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return float(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0.0


def pid_alive(pid: int, start_time: float = 0.0) -> bool:
    """Whether pid runs (not a zombie) and, given start_time, is the same process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return stat[0] != "Z" and (not start_time or float(stat[19]) == start_time)


def stop_local_head(pid: int, *, start_time: float = 0.0, grace_s: float = 30.0) -> bool:
    """SIGTERM the head (it stops its Ray processes), SIGKILL after grace_s; then make sure no
    process it started outlives it (Ray's dashboard leaves forkserver children that linger).
    True if the head and all its descendants are gone."""
    if not pid_alive(pid, start_time):
        return True
    tree = process_tree(pid)  # before they are reparented
    _terminate(pid, start_time, grace_s)
    return not pid_alive(pid, start_time) and stop_processes(tree)


def process_tree(pid: int) -> list[tuple[int, float]]:
    """(pid, start time) of every process below pid."""
    return [(p, process_start_time(p)) for p in descendants(pid)]


def stop_processes(tree: list[tuple[int, float]], grace_s: float = 5.0) -> bool:
    """SIGTERM (SIGKILL after grace_s) each (pid, start time) still running; True if all are gone."""
    for p, started in tree:
        _terminate(p, started, grace_s)
    return not any(pid_alive(p, t) for p, t in tree)


def _terminate(pid: int, start_time: float, grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    signalled = False
    while pid_alive(pid, start_time):
        if not signalled:
            _kill(pid, signal.SIGTERM)
            signalled = True
        elif time.monotonic() > deadline:
            _kill(pid, signal.SIGKILL)
            time.sleep(0.2)
            _reap(pid)
            return
        time.sleep(0.2)
        _reap(pid)


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)  # by pid, checked against its start time by the caller
    except ProcessLookupError:
        pass


def descendants(pid: int) -> list[int]:
    """Every process below pid, from /proc (children before grandchildren)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo += children.get(p, [])
    return out


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)  # our child (foreground head): no zombie
    except ChildProcessError:
        pass


def gcs_reachable(address: str, timeout_s: float = 3.0) -> bool:
    """A quick TCP check of a GCS HOST:PORT (ray.init would retry a dead one for minutes)."""
    host, sep, port = address.rpartition(":")
    if address in ("auto", "local") or "://" in address or not sep or not port.isdigit():
        return True  # let Ray resolve it
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout_s).close()
    except OSError:
        return False
    return True


# -- state file ---------------------------------------------------------------------------------
def state_dir() -> pathlib.Path:
    env = os.environ.get("PDCLUSTER_STATE_DIR")
    if env:
        return pathlib.Path(env)
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return pathlib.Path(base) / "pdcluster"


def state_path(namespace: str) -> pathlib.Path:
    return state_dir() / f"{namespace}.json"


def write_state(namespace: str, state: Mapping[str, Any]) -> pathlib.Path:
    path = state_path(namespace)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(dict(state), f, indent=1)
    os.replace(tmp, path)
    return path


def read_state(namespace: str) -> dict[str, Any] | None:
    try:
        return json.loads(state_path(namespace).read_text())
    except (OSError, ValueError):
        return None


def remove_state(namespace: str) -> None:
    state_path(namespace).unlink(missing_ok=True)
