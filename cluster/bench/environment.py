"""Where a result came from: the machine, the software, the command line and --metadata.

A number without its machine cannot be compared later. Collected without importing torch (that
would cost seconds); the GPU comes from nvidia-smi when the machine has it.
"""

from __future__ import annotations

import os
import platform
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import Sequence
from importlib import metadata as importlib_metadata
from typing import Any


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _gpus() -> list[dict[str, str]]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.strip().splitlines():
        name, memory, driver = (part.strip() for part in (line.split(",") + ["", ""])[:3])
        gpus.append({"name": name, "memory": memory, "driver": driver})
    return gpus


def _version(dist: str) -> str | None:
    try:
        return importlib_metadata.version(dist)
    except importlib_metadata.PackageNotFoundError:
        return None


def collect_environment(metadata: dict[str, str] | None = None, argv: Sequence[str] | None = None) -> dict[str, Any]:
    from pdcluster import __version__

    argv = list(sys.argv if argv is None else argv)
    return {
        "hostname": socket.gethostname(),
        "machine": {
            "platform": platform.platform(),
            "cpu_model": _cpu_model(),
            "cpu_count": os.cpu_count(),
            "memory_bytes": _memory_bytes(),
            "gpus": _gpus(),
        },
        "versions": {
            "python": platform.python_version(),
            "torch": _version("torch"),
            "pdcluster": __version__,
        },
        "command": shlex.join(argv),
        "metadata": dict(metadata or {}),
    }


def parse_metadata(items: Sequence[str] | None) -> dict[str, str]:
    """["gpu=H100", "tp=2"] -> {"gpu": "H100", "tp": "2"}."""
    out = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--metadata takes KEY=VALUE items, got {item!r}")
        out[key.strip()] = value.strip()
    return out
