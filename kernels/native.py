"""C kernels for the CPU, built on first use with the machine's C compiler and loaded with ctypes.

Some CPU ops are memory-bound in a way torch's kernels cannot express without copies (decode
attention over a paged cache reads each block in place here; torch must gather first). Those few
kernels are small C files under kernels/csrc/, compiled here once per (source, compiler, flags, CPU)
into $PDCLUSTER_HOME/native (default ~/.cache/pdcluster/native) and reused by every later process.

- Nothing crosses a process boundary: the library is built from this package's own source, into a
  0700 folder owned by this user, and is refused (never loaded) if the folder or the file is
  writable by anyone else.
- `-march=native`: the key includes the CPU's flags, so a home folder shared by machines of
  different kinds builds one library per kind.
- `-fopenmp`: the kernels' `omp parallel` resolves to the libgomp torch already loaded (same
  SONAME), so they share torch's thread pool instead of starting a second one that would spin
  against it.
- No compiler, a failed build or PDCLUSTER_NATIVE=0: `load()` returns None once, logs why, and the
  callers keep their torch path. A build takes well under a second for these files.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11", "-fno-math-errno",
          "-fno-trapping-math")
BUILD_TIMEOUT_S = 120.0

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def enabled() -> bool:
    return os.environ.get("PDCLUSTER_NATIVE", "1") != "0"


def cache_dir() -> Path:
    home = os.environ.get("PDCLUSTER_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "pdcluster")
    return Path(home) / "native"


def load(name: str) -> ctypes.CDLL | None:
    """The library built from csrc/<name>.c, or None (and a warning, once) when it cannot be had."""
    with _lock:
        if name not in _loaded:
            _loaded[name] = _load(name) if enabled() else None
        return _loaded[name]


def _load(name: str) -> ctypes.CDLL | None:
    try:
        path = _build(name)
        _check_private(path)
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        log.warning("native CPU kernel %s unavailable, using the torch path: %s", name, e)
        return None


def _compiler() -> str:
    cc = os.environ.get("CC") or "cc"
    found = shutil.which(cc)
    if found is None:
        raise OSError(f"no C compiler ({cc!r} not on PATH; set CC)")
    return found


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _build(name: str) -> Path:
    src = CSRC / f"{name}.c"
    # The key covers the shared headers too: a changed helper rebuilds every kernel including it.
    source = b"\0".join([src.read_bytes(), *(h.read_bytes() for h in sorted(CSRC.glob("*.h")))])
    cc = _compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(b"\0".join([source, cc.encode(), version.encode(), " ".join(CFLAGS).encode(),
                                     _cpu_flags().encode()])).hexdigest()[:16]
    out_dir = cache_dir()
    out_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_private(out_dir)
    lib = out_dir / f"{name}-{key}.so"
    if lib.exists():
        return lib
    # Build beside the target and rename: processes building at once never see a partial file.
    fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        r = subprocess.run([cc, *CFLAGS, "-o", tmp, str(src), "-lm"], capture_output=True, text=True,
                           timeout=BUILD_TIMEOUT_S)
        if r.returncode != 0:
            raise OSError(f"{cc} failed on {src.name}: {r.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o700)
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def _check_private(path: Path) -> None:
    """Refuse a folder or library another user could have written: loading it would run their code."""
    st = path.stat()
    if st.st_uid != os.getuid():
        raise ValueError(f"{path} is owned by uid {st.st_uid}, not this user: not loading native kernels from it")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ValueError(f"{path} is writable by group or others: not loading native kernels from it")
