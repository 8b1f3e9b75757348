"""Memory regions: writable byte buffers the data plane reads from and writes into.

A `Region` wraps one contiguous buffer as a flat byte memoryview (`Region.view`). It can be
private memory (bytearray, numpy array, CPU torch tensor, mmap) or a named shared-memory segment
(a file in /dev/shm mapped with mmap) that peers on the same host map directly.

Shared segments deliberately avoid `multiprocessing.shared_memory`: its resource tracker unlinks
segments it thinks leaked when *any* process that opened them exits. Here only the creating
process (the owner) unlinks, in `close()`; openers just unmap. Access control for shared
segments is the file mode (0600: same OS user) plus the control plane only telling authorised
clients the segment name.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import tempfile
import threading
from typing import Any

SHM_PREFIX = "pdcluster-"
_SHM_NAME = re.compile(r"^pdcluster-[A-Za-z0-9_.-]{1,100}$")


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


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
                 owns_shm: bool = False, mm: mmap.mmap | None = None) -> None:
        self.view = view
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
    name = name or f"{SHM_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
    path = _shm_path(name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return Region(memoryview(mm), shm_name=name, owns_shm=True, mm=mm)


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
