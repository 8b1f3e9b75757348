"""Private folders for an actor's key material that never outlive the actor (issue 16).

A Ray actor writes its TLS identity (ray_tls.py) and the router its CURVE keys (ray_secrets.py)
into a folder of its own on its node. A SIGKILLed actor runs no finalizer, so the folder is
tied to the process in three ways, each covering what the one before cannot:

    reaper   a tiny child (`sh`: cat, then rm) holds the read end of a pipe whose write end only
             the owner holds; when the owner dies, however it dies, the kernel closes the pipe
             and the reaper removes the folder at once
    lock     the owner holds a flock on FOLDER/.lock for its lifetime (released by the kernel
             with its last fd); every new private folder first sweeps the base folder for
             this user's pdcluster folders whose lock nobody holds (the reaper was killed
             too, e.g. a cgroup-wide OOM kill) and removes them; pid reuse cannot fool a flock
    tmpfs    the base folder is /dev/shm when it is usable: memory only, so a node that loses
             power or reboots keeps no key on disk

The sweep touches only direct children of the base folder named with our prefixes, that are
real folders (not links), owned by this uid and mode 0700; anything else is left alone.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import pathlib
import shutil
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

PREFIXES = ("pdcluster-tls-", "pdcluster-router-keys-")
LOCK = ".lock"
SHM = "/dev/shm"
# A folder without a lock file is being made (mkdtemp, then the lock); one that old is an owner
# killed in between.
UNLOCKED_GRACE_S = 300.0
_REAPER = 'cat >/dev/null; rm -rf -- "$1"'


def base_dir() -> str:
    """/dev/shm when it is a writable folder (memory only), else the usual temporary folder."""
    if os.path.isdir(SHM) and os.access(SHM, os.W_OK | os.X_OK):
        return SHM
    return tempfile.gettempdir()


@dataclass
class PrivateFolder:
    """A 0700 folder, its lock held, its reaper waiting; close() removes it."""

    path: str
    _lock_fd: int | None = None
    _reaper: subprocess.Popen | None = None
    _pipe_fd: int | None = field(default=None, repr=False)

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        for name in ("_pipe_fd", "_lock_fd"):
            fd = getattr(self, name)
            setattr(self, name, None)
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        reaper, self._reaper = self._reaper, None
        if reaper is not None:  # EOF on its pipe: it removes nothing left and exits
            try:
                reaper.wait(5.0)
            except subprocess.TimeoutExpired:
                reaper.kill()
                reaper.wait()


def make_private_folder(prefix: str, parent: str | None = None, *, base: str | None = None,
                        reaper: bool = True) -> PrivateFolder:
    """A new private folder named PREFIX... in `base` (default: base_dir()), swept first; or
    inside `parent`, another private folder, whose lock and reaper then cover it too."""
    if parent is None:
        base = base or base_dir()
        sweep(base)
    folder = tempfile.mkdtemp(prefix=prefix, dir=parent or base)  # mode 0700
    out = PrivateFolder(folder)
    try:
        if parent is None:
            out._lock_fd = _lock(folder)
            if reaper:
                out._reaper, out._pipe_fd = _start_reaper(folder)
    except BaseException:
        out.close()
        raise
    return out


def _lock(folder: str) -> int:
    fd = os.open(os.path.join(folder, LOCK), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW,
                 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    # A sweeper may have taken the lock between our open and flock and removed the folder.
    if not os.path.exists(os.path.join(folder, LOCK)):
        os.close(fd)
        raise FileNotFoundError(errno.ENOENT, "private folder removed while being made", folder)
    return fd


def _start_reaper(folder: str) -> tuple[subprocess.Popen, int]:
    read_fd, write_fd = os.pipe()  # both O_CLOEXEC: no other child (serve-worker) inherits them
    try:
        proc = subprocess.Popen(["/bin/sh", "-c", _REAPER, "pdcluster-reaper", folder], stdin=read_fd,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)  # signals to our group do not reach it
    except BaseException:
        os.close(write_fd)
        raise
    finally:
        os.close(read_fd)
    return proc, write_fd


def sweep(base: str | None = None, now: float | None = None) -> list[str]:
    """Remove this user's private folders in `base` whose owner is dead; returns their paths."""
    base = base or base_dir()
    now = time.time() if now is None else now
    removed: list[str] = []
    try:
        names = os.listdir(base)
    except OSError:
        return removed
    for name in names:
        if name.startswith(PREFIXES) and _sweep_one(os.path.join(base, name), now):
            removed.append(os.path.join(base, name))
    return removed


def _sweep_one(path: str, now: float) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) != 0o700:
        return False
    lock = pathlib.Path(path) / LOCK
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:  # being made, or its maker died before locking it
        if now - st.st_mtime > UNLOCKED_GRACE_S:
            shutil.rmtree(path, ignore_errors=True)
            return True
        return False
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held: its owner lives
        os.close(fd)
        return False
    try:
        shutil.rmtree(path, ignore_errors=True)  # while we hold the lock: nobody re-adopts it
    finally:
        os.close(fd)
    return True
