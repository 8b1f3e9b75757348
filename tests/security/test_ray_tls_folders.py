"""A SIGKILLed owner's private key folder does not outlive it (cluster/private_dirs.py): its
reaper removes it at once; with the reaper gone too, the next private folder made on the node
sweeps it (its flock is free). Other users', non-0700 and live folders are never touched.
Real subprocesses, really SIGKILLed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from pdcluster.cluster.private_dirs import LOCK, make_private_folder, sweep
from pdcluster.cluster.ray_tls import LauncherTLS, split_env

OWNER = r"""
import json, sys, time
from pdcluster.cluster.private_dirs import make_private_folder
from pdcluster.cluster.ray_tls import write_identity
mode = sys.argv[1]
if mode == "identity":
    pems = json.loads(sys.stdin.read())
    paths = write_identity(pems)
    print(json.dumps({"folder": paths.folder, "key": paths.key}), flush=True)
else:
    f = make_private_folder("pdcluster-tls-", base=sys.argv[2], reaper=False)
    open(f.path + "/key.pem", "w").write("secret")
    print(json.dumps({"folder": f.path}), flush=True)
time.sleep(600)
"""


@pytest.fixture
def owners():
    procs: list[subprocess.Popen] = []

    def start(*argv: str, stdin: str = "") -> tuple[subprocess.Popen, dict]:
        p = subprocess.Popen([sys.executable, "-c", OWNER, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
        procs.append(p)
        p.stdin.write(stdin)
        p.stdin.close()
        line = p.stdout.readline()
        assert line, f"owner exited with {p.wait()}"
        return p, json.loads(line)

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def _gone(path: str, within_s: float = 30.0) -> bool:
    deadline = time.monotonic() + within_s  # bounds a hang only: the reaper acts on the kill
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not os.path.exists(path)


def test_sigkilled_actor_identity_folder_is_removed(owners) -> None:
    _, pems = split_env(LauncherTLS(None).worker_env("both-0"))
    proc, out = owners("identity", stdin=json.dumps(pems))
    assert os.stat(out["key"]).st_mode & 0o777 == 0o600
    assert os.stat(out["folder"]).st_mode & 0o777 == 0o700
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert _gone(out["folder"]), os.listdir(out["folder"])


def test_dead_owners_folder_swept_by_the_next_one(owners, tmp_path) -> None:
    base = str(tmp_path)
    dead, out = owners("bare", base)
    live, live_out = owners("bare", base)
    dead.send_signal(signal.SIGKILL)
    dead.wait()
    assert os.path.exists(out["folder"])  # no reaper: only the sweep removes it
    # Lookalikes the sweep must leave alone: another mode, a link, a lock-less folder being made.
    wide = tmp_path / "pdcluster-tls-wide"
    wide.mkdir(mode=0o755)
    (wide / LOCK).touch()
    os.chmod(wide, 0o755)
    (tmp_path / "pdcluster-tls-link").symlink_to(out["folder"])
    young = tmp_path / "pdcluster-tls-young"
    young.mkdir(mode=0o700)
    mine = make_private_folder("pdcluster-tls-", base=base, reaper=False)
    try:
        assert not os.path.exists(out["folder"])
        assert os.path.exists(live_out["folder"])  # its owner holds the lock
        assert wide.is_dir() and young.is_dir() and (tmp_path / "pdcluster-tls-link").is_symlink()
        # A lock-less folder past the grace period is a maker killed before it locked.
        assert sweep(base, now=time.time() + 3600) == [str(young)]
        assert os.path.exists(mine.path) and os.path.exists(live_out["folder"])
    finally:
        mine.close()
    assert not os.path.exists(mine.path)
    live.send_signal(signal.SIGKILL)
    live.wait()
    assert sweep(base) == [live_out["folder"]]
