"""`pdcluster keys init` through the real CLI entry point."""

from __future__ import annotations

import stat
import subprocess
import sys


def test_keys_init_writes_private_secrets_and_refuses_to_overwrite(tmp_path) -> None:
    d = tmp_path / "keys"
    cmd = [sys.executable, "-m", "pdcluster.cluster.cli", "keys", "init", str(d)]
    subprocess.run(cmd, check=True, capture_output=True)
    secrets = list((d / "secret").iterdir())
    assert secrets and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in secrets)
    assert list((d / "public").iterdir())
    again = subprocess.run(cmd, capture_output=True, text=True)
    assert again.returncode == 2 and "error" in again.stderr
