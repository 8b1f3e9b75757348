"""SharedRegionCache: a same-host client's mappings of peers' shared-memory segments.

Mapping a segment costs a few syscalls and page-table work, so a client keeps each one mapped
and reuses it. A segment is identified by its name; its size is checked on every lookup so a
peer that restarted with a different segment under the same name is re-mapped, never misread.
"""

from __future__ import annotations

import threading

from .region import Region, open_shared_region


class SharedRegionCache:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._maps: dict[tuple[str, bool], Region] = {}

    def get(self, name: str, nbytes: int, *, writable: bool) -> Region:
        """The mapped segment; raises OSError/ValueError when it is absent, foreign or resized."""
        key = (name, writable)
        with self._lock:
            region = self._maps.get(key)
            if region is not None and region.nbytes == nbytes:
                return region
        fresh = open_shared_region(name, writable=writable, expected_nbytes=nbytes)
        with self._lock:
            region = self._maps.get(key)
            if region is not None and region.nbytes == nbytes:
                winner = region  # another thread mapped it meanwhile: use theirs
            else:
                self._maps[key] = winner = fresh
        if winner is not fresh:
            fresh.close()
        # A stale mapping that was replaced is never closed here: another thread may be copying
        # through it right now, and releasing its view would fail that copy. It unmaps when the
        # last reference goes.
        return winner

    def drop(self, name: str) -> None:
        with self._lock:
            gone = [self._maps.pop(k) for k in list(self._maps) if k[0] == name]
        for r in gone:
            r.close()

    def close(self) -> None:
        with self._lock:
            gone = list(self._maps.values())
            self._maps.clear()
        for r in gone:
            r.close()


def local_host_id() -> str:
    """Identifies this host (and boot) for choosing the shared-memory path.

    Hostname plus the kernel boot id: two containers on one host may share a hostname but not
    /dev/shm, so a match is only a hint -- callers fall back to TCP when mapping fails.
    """
    import socket

    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "noboot"
    return f"{socket.gethostname()}/{boot}"
