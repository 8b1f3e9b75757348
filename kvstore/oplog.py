"""Append-only operation log plus snapshot: the kvstore master's durability.

Files in the log directory:

    snapshot          header | msgpack state (includes `gen`: replay logs with gen >= it)
    oplog.<gen>       record | record | ...     record = len u32 | crc32 u32 | msgpack map

Recovery = load snapshot (if any), then replay every `oplog.<g>` with g >= snapshot gen, in order.
A torn last record of the newest log (crash mid-append) is ignored and truncated away; a bad
record anywhere else is corruption and raises -- never silently drop acknowledged operations.

Snapshot = rotate to a fresh log generation (under the master's lock, together with
serialising the state), then write `snapshot.tmp`, fsync, rename over `snapshot`, fsync the
directory, and only then delete older logs. A crash at any step leaves an older snapshot plus
every log after it, which replays to the same state.

fsync policy: "always" (fsync each record before replying), "interval" (each record is written
to the OS at once -- a process crash loses nothing -- and fsynced every `fsync_interval_s`; a
power loss can lose that window), "never" (leave it to the OS).
"""

from __future__ import annotations

import os
import re
import struct
import threading
import time
import zlib
from typing import IO, Any

import msgpack

from pdcluster.security.envelope import MalformedMessage, unpack_bounded

RECORD = struct.Struct("!II")  # length, crc32
MAX_RECORD = 16 << 20
SNAP_MAGIC = b"PDKVSNP1"
SNAP_HEADER = struct.Struct("!8sQI")  # magic, length, crc32
FSYNC_POLICIES = ("always", "interval", "never")
_LOG_NAME = re.compile(r"^oplog\.(\d{12})$")


class OpLogCorrupt(Exception):
    """A record or snapshot in the middle of the history is unreadable."""


def decode(payload: bytes) -> dict[str, Any]:
    """Bounded, ext-free msgpack decode of one record/snapshot into a str-keyed map."""
    try:
        obj = unpack_bounded(payload, max(len(payload), 1))  # our size bound is checked by the caller
    except MalformedMessage as e:
        raise OpLogCorrupt(f"undecodable record: {e}") from e
    if not isinstance(obj, dict):
        raise OpLogCorrupt("record is not a map")
    return obj


def encode(obj: dict[str, Any]) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


class OpLog:
    def __init__(self, directory: str, fsync: str = "interval", fsync_interval_s: float = 0.05) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync must be one of {FSYNC_POLICIES}")
        self.dir = directory
        self.fsync_policy = fsync
        self.fsync_interval_s = fsync_interval_s
        os.makedirs(directory, exist_ok=True)
        self.gen = 0
        self.records_since_snapshot = 0
        self._f: IO[bytes] | None = None
        self._dirty = False
        self._last_sync = time.monotonic()
        self._file_lock = threading.Lock()  # serialises file writes against rotate/sync

    # -- recovery ----------------------------------------------------------------------------
    def recover(self) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        """Read snapshot and logs; return (snapshot or None, records after it). Opens the writer."""
        snap = self._read_snapshot()
        base = int(snap["gen"]) if snap else 0
        gens = sorted(g for g in self._log_gens() if g >= base)
        records: list[dict[str, Any]] = []
        for i, g in enumerate(gens):
            records.extend(self._read_log(g, last=i == len(gens) - 1))
        self.gen = max(gens + [base, 0]) + 1
        self._open(self.gen)
        self.records_since_snapshot = len(records)
        return snap, records

    @property
    def is_open(self) -> bool:
        return self._f is not None

    def open_fresh(self) -> None:
        """Open a new log generation above every file here without reading them: a promoted
        standby's state came from its primary, and its next snapshot supersedes what is on disk."""
        self.gen = max(self._log_gens() + [0]) + 1
        self._open(self.gen)
        self.records_since_snapshot = 0

    def _log_gens(self) -> list[int]:
        return [int(m.group(1)) for f in os.listdir(self.dir) if (m := _LOG_NAME.match(f))]

    def _path(self, gen: int) -> str:
        return os.path.join(self.dir, f"oplog.{gen:012d}")

    def _read_log(self, gen: int, last: bool) -> list[dict[str, Any]]:
        with open(self._path(gen), "rb") as f:
            data = f.read()
        out, pos = [], 0
        while pos < len(data):
            bad, end = None, len(data)
            if pos + RECORD.size > len(data):
                bad = "short header"
            else:
                n, crc = RECORD.unpack_from(data, pos)
                end = pos + RECORD.size + n
                if n > MAX_RECORD:
                    bad = "oversize record"
                elif end > len(data):
                    bad = "short record"
                elif zlib.crc32(data[pos + RECORD.size:end]) != crc:
                    bad = "crc mismatch"
            if bad is not None:
                # Torn tail: only acceptable as the very last record of the newest log.
                # A torn append leaves a prefix of the record, or (after a power loss) a
                # full-length record with garbage/zeros at the end of the file.
                torn_tail = last and (bad in ("short header", "short record")
                                      or (bad == "crc mismatch" and end == len(data)))
                if not torn_tail:
                    raise OpLogCorrupt(f"{self._path(gen)} at byte {pos}: {bad}")
                with open(self._path(gen), "r+b") as f:
                    f.truncate(pos)
                break
            out.append(decode(data[pos + RECORD.size:end]))
            pos = end
        return out

    def _read_snapshot(self) -> dict[str, Any] | None:
        path = os.path.join(self.dir, "snapshot")
        if not os.path.exists(path):
            return None
        with open(path, "rb") as f:
            head = f.read(SNAP_HEADER.size)
            if len(head) != SNAP_HEADER.size:
                raise OpLogCorrupt("short snapshot header")
            magic, n, crc = SNAP_HEADER.unpack(head)
            if magic != SNAP_MAGIC or n != os.fstat(f.fileno()).st_size - SNAP_HEADER.size:
                raise OpLogCorrupt("bad snapshot header")
            body = f.read(n)
        if zlib.crc32(body) != crc:
            raise OpLogCorrupt("snapshot crc mismatch")
        snap = decode(body)
        if not isinstance(snap.get("gen"), int):
            raise OpLogCorrupt("snapshot without gen")
        return snap

    # -- writing -----------------------------------------------------------------------------
    def _open(self, gen: int) -> None:
        self._f = open(self._path(gen), "ab")  # noqa: SIM115 - lives until rotate/close

    def append(self, rec: dict[str, Any]) -> None:
        payload = encode(rec)
        if len(payload) > MAX_RECORD:
            raise ValueError("op-log record too large")
        with self._file_lock:
            assert self._f is not None, "recover() first"
            self._f.write(RECORD.pack(len(payload), zlib.crc32(payload)) + payload)
            self._f.flush()  # in the OS now: a process crash cannot lose it
            if self.fsync_policy == "always":
                os.fsync(self._f.fileno())
            else:
                self._dirty = True
            self.records_since_snapshot += 1

    def maybe_sync(self) -> None:
        """Called periodically: fsync under the "interval" policy."""
        with self._file_lock:
            due = time.monotonic() - self._last_sync >= self.fsync_interval_s
            if self._f is not None and self._dirty and self.fsync_policy == "interval" and due:
                os.fsync(self._f.fileno())
                self._dirty = False
                self._last_sync = time.monotonic()

    def rotate(self) -> int:
        """Start a new log generation; the caller serialises state for it under the same lock."""
        with self._file_lock:
            if self._f is not None:
                self._f.flush()
                if self.fsync_policy != "never":
                    os.fsync(self._f.fileno())
                self._f.close()
            self.gen += 1
            self._open(self.gen)
            self._dirty = False
            self.records_since_snapshot = 0
            return self.gen

    def write_snapshot(self, state: dict[str, Any], gen: int) -> None:
        """Durably install a snapshot covering everything before log `gen`, then drop older logs."""
        body = encode({**state, "gen": gen})
        tmp = os.path.join(self.dir, "snapshot.tmp")
        with open(tmp, "wb") as f:
            f.write(SNAP_HEADER.pack(SNAP_MAGIC, len(body), zlib.crc32(body)) + body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(self.dir, "snapshot"))
        dfd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        for g in self._log_gens():
            if g < gen:
                os.unlink(self._path(g))

    def close(self) -> None:
        with self._file_lock:
            if self._f is not None:
                self._f.flush()
                if self.fsync_policy != "never":
                    os.fsync(self._f.fileno())
                self._f.close()
                self._f = None


# -- the primary's term (kvstore/failover.py) ---------------------------------------------------
# Kept beside the log, not in it: like Raft's currentTerm it must be durable before the first
# record of the term is written, and a snapshot's compaction must never drop it.
def read_epoch(directory: str) -> int:
    try:
        with open(os.path.join(directory, "epoch"), "rb") as f:
            text = f.read(32).strip()
    except FileNotFoundError:
        return 0
    if not text.isdigit():
        raise OpLogCorrupt(f"bad epoch file in {directory}")
    return int(text)


def write_epoch(directory: str, epoch: int) -> None:
    """Atomically and durably record `epoch` (tmp file, fsync, rename, fsync the directory)."""
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, "epoch.tmp")
    with open(tmp, "wb") as f:
        f.write(b"%d\n" % epoch)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, "epoch"))
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
