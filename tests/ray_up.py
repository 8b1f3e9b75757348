"""`pdcluster up` as a real Ray cluster for tests: the CLI as a subprocess, and an isolated state
folder + namespace whose finalizer brings down whatever is still up (`down`, then the local Ray
head by its recorded pid and start time), pass or fail."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Iterator


def cli(env: dict, *argv: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdcluster.cluster.cli", *argv], env=env, capture_output=True,
                          text=True, timeout=timeout)


def cluster_env(tmp_path: pathlib.Path, prefix: str) -> Iterator[tuple[dict, str]]:
    """Yield (env, namespace) for `up`/`down` calls; afterwards stop what they left running."""
    from pdcluster.cluster import ray_head

    ns = f"{prefix}{os.getpid()}"
    env = {**os.environ, "PDCLUSTER_STATE_DIR": str(tmp_path / "state")}
    env.pop("RAY_ADDRESS", None)
    yield env, ns
    path = pathlib.Path(env["PDCLUSTER_STATE_DIR"]) / f"{ns}.json"
    state = json.loads(path.read_text()) if path.exists() else None
    if state is not None:
        cli(env, "down", "--namespace", ns, timeout=180)
        if state.get("head_pid"):
            ray_head.stop_local_head(state["head_pid"], start_time=state.get("head_start", 0))
