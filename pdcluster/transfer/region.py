"""Memory regions: writable byte buffers the data plane reads from and writes into.

A `Region` wraps one contiguous buffer as a flat byte memoryview (`Region.view`). It can be
private memory (bytearray, numpy array, CPU torch tensor, mmap) or a named shared-memory segment
(a file in /dev/shm mapped with mmap) that peers on the same host map directly.

Shared segments deliberately avoid `multiprocessing.shared_memory`: its resource tracker unlinks
segments it thinks leaked when *any* process that opened them exits. Here only the creating
process (the owner) unlinks, in `close()`; openers just unmap. An owner that is killed cannot
unlink, so every owner holds a shared flock on its segment for its lifetime (the kernel drops it
when the process dies, whatever its pid namespace), and the first segment a process creates
first reaps this user's segments that nobody holds any more (`reap_orphaned_segments`). Access control for shared
segments is the file mode (0600: same OS user) plus the control plane only telling authorised
clients the segment name.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
import tempfile
import threading
from typing import Any

log = logging.getLogger(__name__)
SHM_PREFIX = "pdcluster-"
_SHM_NAME = re.compile(r"^pdcluster-[A-Za-z0-9_.-]{1,100}$")


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class ShmSpaceError(OSError):
    """The shared-memory folder has no room for a segment: refused when it is made, because
    a segment is sparse and the first touch of a page past the room kills the process (SIGBUS).
    A check, not a reservation (reserving would commit the memory at once): segments that several
    processes make at the same moment can still outgrow the room together."""


def shm_free_bytes() -> int:
    """Bytes the shared-memory folder can still hand out (a container's /dev/shm is 64 MiB
    unless --shm-size says otherwise)."""
    st = os.statvfs(shm_dir())
    return st.f_bavail * st.f_frsize


def _shm_path(name: str) -> str:
    # The name may come from a remote control plane: never let it escape the shm directory.
    if not _SHM_NAME.match(name) or ".." in name:
        raise ValueError(f"invalid shared memory name {name!r}")
    return os.path.join(shm_dir(), name)


def as_byte_view(obj: Any, *, writable: bool) -> memoryview:
    """A flat 'B' memoryview over a contiguous buffer (bytes-like, numpy array, CPU torch tensor)."""
    if hasattr(obj, "data_ptr") and hasattr(obj, "is_contiguous"):  # torch.Tensor, without importing torch
        if obj.device.type != "cpu" or not obj.is_contiguous():
            raise ValueError("tensor must be a contiguous CPU tensor")
        # Via uint8 so dtypes numpy lacks (bfloat16) still work; shares memory, no copy.
        obj = obj.reshape(-1).view(__import__("torch").uint8).numpy()
    mv = memoryview(obj)  # always a fresh view: releasing ours must not release the caller's
    if not mv.c_contiguous:
        raise ValueError("buffer must be C-contiguous")
    if writable and mv.readonly:
        raise ValueError("buffer must be writable")
    return mv.cast("B") if (mv.format != "B" or mv.ndim != 1) else mv


class Region:
    """A registered buffer. `view` is a flat writable byte memoryview of `nbytes`."""

    def __init__(self, view: memoryview, *, owner_ref: Any = None, shm_name: str | None = None,
                 owns_shm: bool = False, mm: mmap.mmap | None = None, lock_fd: int | None = None) -> None:
        self.view = view
        self._lock_fd = lock_fd  # an owner's open segment file, flocked while the segment lives
        self.nbytes = view.nbytes
        self.shm_name = shm_name
        self._owner_ref = owner_ref  # keeps the underlying object alive
        self._owns_shm = owns_shm
        self._mmap = mm
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def from_buffer(cls, obj: Any) -> Region:
        return cls(as_byte_view(obj, writable=True), owner_ref=obj)

    @property
    def readonly(self) -> bool:
        return self.view.readonly

    def as_numpy(self, dtype: Any = "uint8", shape: tuple[int, ...] | None = None, offset: int = 0) -> Any:
        import numpy as np

        dt = np.dtype(dtype)
        count = -1 if shape is None else int(np.prod(shape, dtype=np.int64))
        arr = np.frombuffer(self.view, dtype=dt, count=count, offset=offset)
        return arr if shape is None else arr.reshape(shape)

    def as_tensor(self, dtype: Any, shape: tuple[int, ...], offset: int = 0) -> Any:
        """A torch tensor sharing this region's memory (no copy)."""
        import math

        import torch

        count = math.prod(shape)
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        if offset < 0 or offset + nbytes > self.nbytes:
            raise ValueError("tensor does not fit in region")
        return torch.frombuffer(self.view, dtype=dtype, count=count, offset=offset).view(shape)

    def close(self) -> None:
        """Release the view; the owner of a shared segment also unlinks it. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._owns_shm and self.shm_name:
            try:
                os.unlink(_shm_path(self.shm_name))
            except FileNotFoundError:
                pass
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # drops the flock
            self._lock_fd = None
        try:
            self.view.release()
            if self._mmap is not None:
                self._mmap.close()
        except BufferError:
            # Someone still holds a slice (e.g. a tensor view); the mapping goes when they do.
            pass

    def __enter__(self) -> Region:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Owners must not leak /dev/shm files even if close() was forgotten.
        if getattr(self, "_owns_shm", False) and not getattr(self, "_closed", True):
            self.close()


def alloc_region(nbytes: int, shared: bool = False, name: str | None = None) -> Region:
    """Allocate a zeroed region; `shared=True` puts it in a named shared-memory segment we own."""
    if nbytes <= 0:
        raise ValueError("nbytes must be positive")
    if not shared:
        return Region.from_buffer(bytearray(nbytes))
    _reap_once()
    free = shm_free_bytes()
    if nbytes > free:
        raise ShmSpaceError(errno.ENOSPC, f"{shm_dir()} has {free:,} bytes free; a shared segment of {nbytes:,} bytes "
                                          "would fault (SIGBUS) once its pages outgrow that: give it more room "
                                          "(docker run --shm-size) or ask for less")
    name = name or f"{SHM_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
    path = _shm_path(name)
    # Built under a hidden name and locked before it gets its real one: a reaper never sees a
    # segment of ours without our lock on it.
    tmp = os.path.join(shm_dir(), f".{name}.{secrets.token_hex(4)}.new")
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            os.link(tmp, path)  # unlike rename, never replaces an existing segment
        except BaseException:
            mm.close()
            raise
    except BaseException:
        os.close(fd)
        raise
    finally:
        os.unlink(tmp)
    return Region(memoryview(mm), shm_name=name, owns_shm=True, mm=mm, lock_fd=fd)


_reaped = False
_reap_lock = threading.Lock()


def _reap_once() -> None:
    global _reaped
    with _reap_lock:
        if _reaped:
            return
        _reaped = True
    try:
        gone = reap_orphaned_segments()
    except OSError as e:  # best effort: never stop a segment from being made
        log.warning("could not look for orphaned shared-memory segments: %s", e)
        return
    if gone:
        log.info("removed %d orphaned shared-memory segment(s) of dead processes: %s", len(gone), ", ".join(gone))


def reap_orphaned_segments() -> list[str]:
    """Unlink this user's pdcluster segments whose owner is gone (nobody holds their flock).
    Returns their names. Peers that still map one keep their mapping; it just has no name."""
    gone = []
    root = shm_dir()
    uid = os.getuid()
    for name in os.listdir(root):
        half_made = name.startswith("." + SHM_PREFIX) and name.endswith(".new")  # killed mid-create
        if not half_made and not (name.startswith(SHM_PREFIX) and _SHM_NAME.match(name)):
            continue
        path = os.path.join(root, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue  # gone meanwhile, or not ours to open
        try:
            st = os.fstat(fd)
            # Segments are regular files; anything else under the prefix (a 0700 folder of ours,
            # e.g. cluster/private_dirs.py's pdcluster-tls-*) is not one, and unlinking it would
            # raise and end the whole reap.
            if st.st_uid != uid or not stat.S_ISREG(st.st_mode):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its owner is alive
            try:
                if os.stat(path).st_ino == st.st_ino:  # still the file we locked
                    os.unlink(path)
                    gone.append(name)
            except FileNotFoundError:
                pass
        finally:
            os.close(fd)
    return gone


def open_shared_region(name: str, *, writable: bool, expected_nbytes: int | None = None) -> Region:
    """Map a peer's shared segment (same host). The caller never unlinks it."""
    fd = os.open(_shm_path(name), os.O_RDWR if writable else os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if expected_nbytes is not None and size != expected_nbytes:
            raise ValueError(f"shared segment {name} has {size} bytes, expected {expected_nbytes}")
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
    finally:
        os.close(fd)
    return Region(memoryview(mm), shm_name=name, owns_shm=False, mm=mm)
