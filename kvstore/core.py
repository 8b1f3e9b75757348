"""MasterCore: the master's state behind one lock, its durability, clock and token minting.

Write-ahead: every state change is appended to the op log (inside the same locked call) before
the RPC that caused it replies, so an acknowledged put survives a master restart (subject to the
fsync policy, see oplog.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from pdcluster.transfer import issue_token
from pdcluster.transfer import now_ms as wall_ms

from .entities import MasterConfig, Placement
from .metadata import MetadataStore
from .oplog import OpLog
from .persistence import apply_record, finish_recovery, load_snapshot, snapshot_state
from .secret import node_key

log = logging.getLogger(__name__)


class MasterCore:
    def __init__(self, config: MasterConfig, secret: bytes, data_dir: str | None = None, *,
                 fsync: str = "interval", snapshot_interval_s: float = 300.0,
                 snapshot_every_records: int = 100_000, clock: Callable[[], int] = wall_ms) -> None:
        self.config = config
        self.lock = threading.Lock()
        self.clock = clock
        self._secret = secret
        self._node_keys: dict[str, bytes] = {}
        self.oplog = OpLog(data_dir, fsync=fsync) if data_dir else None
        self.store = MetadataStore(config)
        self._snapshot_interval_s = snapshot_interval_s
        self._snapshot_every = snapshot_every_records
        self._last_snapshot = time.monotonic()
        self._snap_lock = threading.Lock()

    def recover(self) -> int:
        """Rebuild state from snapshot + op log, then compact into a fresh snapshot. Returns #objects."""
        if self.oplog is None:
            return 0
        snap, records = self.oplog.recover()
        now = self.clock()
        with self.lock:
            if snap is not None:
                load_snapshot(self.store, snap, now)
            for rec in records:
                apply_record(self.store, rec, now)
            finish_recovery(self.store, now)
            self.store._log = self.oplog.append  # from here on, every change is logged
            n = self.store.stats()["objects"]
        self.snapshot()
        log.info("kvstore master recovered %d objects from %s (%d log records)", n, self.oplog.dir, len(records))
        return int(n)

    def snapshot(self) -> None:
        if self.oplog is None:
            return
        with self._snap_lock:
            with self.lock:  # state and log generation must match exactly
                gen = self.oplog.rotate()
                state = snapshot_state(self.store)
            self.oplog.write_snapshot(state, gen)  # slow part, outside the lock
            self._last_snapshot = time.monotonic()

    def tick(self) -> None:
        with self.lock:
            self.store.tick(self.clock())
        if self.oplog is None:
            return
        self.oplog.maybe_sync()
        due = time.monotonic() - self._last_snapshot >= self._snapshot_interval_s
        if self.oplog.records_since_snapshot and (due or self.oplog.records_since_snapshot >= self._snapshot_every):
            self.snapshot()

    def close(self) -> None:
        if self.oplog is not None:
            self.oplog.close()

    def token(self, p: Placement, op: int, size: int, expiry_ms: int) -> bytes:
        """A capability for exactly this placement's object bytes, signed with its node's key."""
        node_id = p.seg.node_id
        key = self._node_keys.get(node_id)
        if key is None:
            key = self._node_keys[node_id] = node_key(self._secret, node_id)
        return issue_token(key, os.urandom(16), op, p.seg.segment_id, [(p.offset, size)], expiry_ms=expiry_ms)
