"""MetadataStore: every piece of master state and the rules over it (no I/O, no threads, no clock).

Callers pass `now` (unix ms) and hold one lock around every call. Each state change goes
through a small primitive (`_do_*`) and is logged as that primitive's arguments, so op-log replay
(persistence.py) calls the same primitives and reaches the same state.

Lifecycle of an object:

    put_start -> PENDING --put_end--> PUBLISHED --remove / evict / node loss--> gone
                  +--put_revoke / timeout / segment loss--> gone
    arena_reserve -> arena --arena_commit (any number of times)--> PUBLISHED objects
                       +--arena_release / expiry / node loss--> gone (its untaken rest quarantined)

Invariants:
- Only PUBLISHED objects are visible (get/exists); a key has at most one object.
- Bytes of a gone object are reused only after every token that could touch them has expired:
  free_at = max(lease_until, write_expiry) + grace. Until then they sit in the quarantine
  (quarantine.py). A gone arena's untaken space likewise waits for its (fixed) write_expiry + grace.
- Eviction skips pinned, leased (lease_until > now) and PENDING objects, and never touches
  arenas (they are like PENDING puts: counted as used until they go). Arena rules: arena.py.

Nodes, segments and placement are the SegmentTable (segments.py); this module holds what happens
to objects and arenas on top of them.
"""

from __future__ import annotations

import secrets
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from .arena import Arena
from .entities import PENDING, PUBLISHED, MasterConfig, Node, Obj, Placement, Segment, Status
from .quarantine import Quarantine
from .segments import SegmentTable, SegSpec

# An arena commit item: (key, offset, size) or, with the writer's object MAC, (key, offset, size, mac).
ArenaItem = tuple[str, int, int] | tuple[str, int, int, bytes]


class MetadataStore:
    def __init__(self, config: MasterConfig, log: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.cfg = config
        self.table = SegmentTable(config.align)
        self.nodes: dict[str, Node] = self.table.nodes  # the same dict: read by the servicer and persistence
        self.objects: dict[str, Obj] = {}
        self.arenas: dict[str, Arena] = {}
        self.lru: OrderedDict[str, None] = OrderedDict()  # PUBLISHED keys, least recently used first
        self.quarantine = Quarantine()
        self.published_bytes = 0  # kept incrementally: stats are scraped often, objects may be millions
        self.counters: Counter[str] = Counter()
        self._log = log

    @property
    def quarantined_bytes(self) -> int:
        return self.quarantine.bytes

    def _emit(self, rec: dict[str, Any]) -> None:
        if self._log is not None:
            self._log(rec)

    def _to_ms(self, seconds: float) -> int:
        return int(seconds * 1000)

    # -- capacity ----------------------------------------------------------------------------
    def segments(self) -> list[Segment]:
        return self.table.segments()

    def capacity(self) -> int:
        return self.table.capacity()

    def used(self) -> int:
        return self.table.used()

    # -- puts --------------------------------------------------------------------------------
    def put_start(self, key: str, size: int, replica_num: int, pinned: bool, now: int) -> tuple[Status, Obj | None]:
        cfg = self.cfg
        if not self._valid_key(key) or not 0 < size <= cfg.max_object_size:
            return Status.INVALID, None
        if (status := self._key_taken(key)) is not None:
            return status, None
        placements = self._place_evicting(size, replica_num, now)
        if not placements:
            self.counters["put_no_space"] += 1
            return Status.NO_SPACE, None
        put_id = secrets.token_hex(16)
        wexp = now + self._to_ms(cfg.put_timeout_s)
        self._do_start(key, size, put_id, pinned, wexp, placements)
        self._emit({"op": "start", "key": key, "size": size, "put_id": put_id, "pinned": pinned,
                    "wexp": wexp, "pl": [encode_placement(p) for p in placements]})
        self.counters["puts_started"] += 1
        return Status.OK, self.objects[key]

    def _valid_key(self, key: str) -> bool:
        return bool(key) and len(key.encode()) <= self.cfg.max_key_len

    def _key_taken(self, key: str) -> Status | None:
        obj = self.objects.get(key)
        if obj is None:
            return None
        return Status.ALREADY_EXISTS if obj.state == PUBLISHED else Status.IN_PROGRESS

    def _place_evicting(self, size: int, replica_num: int, now: int) -> list[Placement]:
        replica_num = max(1, min(replica_num, self.cfg.max_replicas))
        placements = self.table.place(size, replica_num)
        evicted = 0
        while not placements and evicted < 256 and self._evict_one(now):  # make room, LRU first
            evicted += 1
            placements = self.table.place(size, replica_num)
        return placements

    def put_end(self, key: str, put_id: str, now: int, mac: bytes = b"") -> Status:
        obj = self.objects.get(key)
        if obj is None or obj.put_id != put_id:
            return Status.NOT_FOUND  # revoked, timed out, lost its node, or another client's put
        if obj.state == PUBLISHED:
            return Status.OK  # idempotent retry
        self._do_publish(key, mac)
        self._emit({"op": "put", "key": key, "mac": mac})
        self.counters["puts_completed"] += 1
        self.evict_to_watermark(now)
        return Status.OK

    def put_revoke(self, key: str, put_id: str, now: int) -> Status:
        obj = self.objects.get(key)
        if obj is None or obj.put_id != put_id or obj.state != PENDING:
            return Status.NOT_FOUND
        self._delete_logged(obj, now, "puts_revoked")
        return Status.OK

    # -- arenas (one-RPC puts; rules in arena.py) ----------------------------------------------
    def arena_reserve(self, size: int, replica_num: int, now: int) -> tuple[Status, Arena | None]:
        """An arena of `size` bytes or less: at most arena_max_fraction of the largest segment.
        Never evicts: an arena is speculative space (the client falls back to two-phase puts,
        which do evict), and making room for it would push out objects just published."""
        if not 0 < size <= self.cfg.max_object_size:
            return Status.INVALID, None
        cap = int(max((s.alloc.capacity for s in self.segments()), default=0) * self.cfg.arena_max_fraction)
        size = min(size, cap - cap % self.cfg.align)
        replica_num = max(1, min(replica_num, self.cfg.max_replicas))
        placements = self.table.place(size, replica_num) if size > 0 else []
        if not placements:
            self.counters["arena_no_space"] += 1
            return Status.NO_SPACE, None
        arena_id = secrets.token_hex(16)
        wexp = now + self._to_ms(self.cfg.put_timeout_s)  # fixed: see arena.py
        self._do_arena_reserve(arena_id, wexp, placements)
        self._emit({"op": "arena", "id": arena_id, "wexp": wexp,
                    "pl": [encode_placement(p) + [p.alloc_size] for p in placements]})
        self.counters["arenas_reserved"] += 1
        return Status.OK, self.arenas[arena_id]

    def arena_commit(self, arena_id: str, items: Sequence[ArenaItem], pinned: bool,
                     now: int) -> tuple[Status, list[Status]]:
        """Publish each (key, offset, size) written into the arena. NOT_FOUND (for the call and
        every item) once the arena is gone or its write tokens expired."""
        arena = self.arenas.get(arena_id)
        if arena is None or now > arena.write_expiry_ms:
            return Status.NOT_FOUND, [Status.NOT_FOUND] * len(items)
        statuses, done = [], []
        for item in items:
            key, off, size, mac = _item(item)
            if not self._valid_key(key) or not 0 < size or not arena.fits(off, self._round(size), self.cfg.align):
                statuses.append(Status.INVALID)
            elif (status := self._key_taken(key)) is not None:
                statuses.append(status)
            else:  # applied one by one so a later item overlapping this one is INVALID
                self._do_arena_commit(arena_id, [(key, off, size, mac)], pinned)
                done.append([key, off, size, mac])
                statuses.append(Status.OK)
        if done:
            self._emit({"op": "acommit", "id": arena_id, "pinned": pinned, "items": done})
            self.counters["puts_completed"] += len(done)
            self.counters["arena_objects"] += len(done)
            self.evict_to_watermark(now)
        return Status.OK, statuses

    def arena_release(self, arena_id: str, now: int) -> Status:
        arena = self.arenas.get(arena_id)
        if arena is None:
            return Status.NOT_FOUND
        self._release_logged(arena, now, "arenas_released")
        return Status.OK

    def _round(self, size: int) -> int:
        return max(self.cfg.align, -(-size // self.cfg.align) * self.cfg.align)

    def _release_logged(self, arena: Arena, now: int, counter: str) -> None:
        # Not sooner than expiry + grace, even when released early: the client's WRITE tokens
        # cover the whole arena until its expiry.
        free_at = arena.write_expiry_ms + self._to_ms(self.cfg.grace_s)
        self._do_arena_release(arena.arena_id, free_at, now)
        self._emit({"op": "arel", "id": arena.arena_id, "free_at": free_at})
        self.counters[counter] += 1

    # -- reads -------------------------------------------------------------------------------
    def get(self, key: str, now: int) -> Obj | None:
        """A PUBLISHED object under a fresh read lease, or None (a miss)."""
        obj = self.objects.get(key)
        if obj is None or obj.state != PUBLISHED:
            self.counters["misses"] += 1
            return None
        obj.lease_until_ms = max(obj.lease_until_ms, now + self._to_ms(self.cfg.lease_ttl_s))
        self.lru.move_to_end(key)
        self.counters["hits"] += 1
        return obj

    def exists(self, key: str) -> bool:
        obj = self.objects.get(key)
        return obj is not None and obj.state == PUBLISHED

    def remove(self, key: str, now: int) -> Status:
        """Hide the key now; its bytes are reused only after its leases expire (quarantine)."""
        obj = self.objects.get(key)
        if obj is None:
            return Status.NOT_FOUND
        if obj.state != PUBLISHED:
            return Status.IN_PROGRESS
        self._delete_logged(obj, now, "removes")
        return Status.OK

    # -- eviction ----------------------------------------------------------------------------
    def evict_to_watermark(self, now: int) -> int:
        cap = self.capacity()
        if cap == 0 or self.used() - self.quarantined_bytes <= self.cfg.high_watermark * cap:
            return 0
        n = 0
        while self.used() - self.quarantined_bytes > self.cfg.low_watermark * cap and self._evict_one(now):
            n += 1
        return n

    def _evict_one(self, now: int) -> bool:
        for key in self.lru:  # oldest first; approximately LRU (gets touch, exists does not)
            obj = self.objects[key]
            if not obj.pinned and obj.lease_until_ms <= now:
                self._delete_logged(obj, now, "evictions")
                return True
        return False

    # -- nodes -------------------------------------------------------------------------------
    def mount(self, node_id: str, host: str, port: int, host_id: str, segs: Sequence[SegSpec], now: int) -> None:
        self._do_mount(node_id, host, port, host_id, segs, now)
        self._emit({"op": "mount", "node": node_id, "host": host, "port": port, "host_id": host_id,
                    "segs": [list(s) for s in segs]})

    def unmount(self, node_id: str, sids: Sequence[int] | None, now: int) -> Status:
        if node_id not in self.nodes:
            return Status.UNKNOWN_NODE
        self._do_unmount(node_id, None if sids is None else list(sids), now)
        self._emit({"op": "unmount", "node": node_id, "sids": None if sids is None else list(sids)})
        return Status.OK

    def heartbeat(self, node_id: str, segs: Sequence[tuple[int, int]], now: int) -> Status:
        """segs: (segment_id, incarnation). UNKNOWN_NODE tells the node to mount (again)."""
        return self.table.heartbeat(node_id, segs, now)

    def tick(self, now: int) -> None:
        """Periodic: reclaim timed-out puts, drop silent nodes, release quarantine, evict."""
        for obj in [o for o in self.objects.values() if o.state == PENDING and now > o.write_expiry_ms]:
            self._delete_logged(obj, now, "puts_timed_out")
        for arena in [a for a in self.arenas.values() if now > a.write_expiry_ms]:
            self._release_logged(arena, now, "arenas_expired")
        dead_after = self._to_ms(self.cfg.node_timeout_s)
        for node_id in [n.node_id for n in self.nodes.values() if now - n.last_seen_ms > dead_after]:
            self.counters["nodes_lost"] += 1
            self.unmount(node_id, None, now)
        for extents in self.quarantine.pop_due(now):
            self._free(extents, counted=True)
        self.evict_to_watermark(now)

    # -- primitives (shared with replay) ------------------------------------------------------
    def _do_start(self, key: str, size: int, put_id: str, pinned: bool, wexp: int,
                  placements: list[Placement]) -> None:
        self.objects[key] = Obj(key, size, placements, PENDING, put_id, pinned, wexp)

    def _do_publish(self, key: str, mac: bytes = b"") -> None:
        obj = self.objects[key]
        obj.state = PUBLISHED
        obj.mac = mac
        self.lru[key] = None
        self.published_bytes += obj.size
        for p in obj.placements:  # per segment too, for the node's /metrics (heartbeat reply)
            p.seg.objects += 1
            p.seg.object_bytes += obj.size

    def _do_arena_reserve(self, arena_id: str, wexp: int, placements: list[Placement]) -> None:
        self.arenas[arena_id] = Arena(arena_id, placements[0].alloc_size, placements, wexp)

    def _do_arena_commit(self, arena_id: str, items: Sequence[ArenaItem], pinned: bool) -> None:
        arena = self.arenas[arena_id]
        for item in items:
            key, off, size, mac = _item(item)
            n = self._round(size)
            arena.take(off, n)  # from here on the object owns (and eventually frees) this range
            self.objects[key] = Obj(key, size, arena.sub_placements(off, n), PENDING, arena_id, pinned,
                                    arena.write_expiry_ms)
            self._do_publish(key, mac)

    def _do_arena_release(self, arena_id: str, free_at: int, now: int) -> None:
        arena = self.arenas.pop(arena_id)
        self._retire(arena.owned_extents(), free_at, now)

    def _delete_logged(self, obj: Obj, now: int, counter: str) -> None:
        free_at = max(obj.lease_until_ms, obj.write_expiry_ms) + self._to_ms(self.cfg.grace_s)
        self._do_delete(obj.key, free_at, now)
        self._emit({"op": "del", "key": obj.key, "free_at": free_at})
        self.counters[counter] += 1

    def _do_delete(self, key: str, free_at: int, now: int) -> None:
        obj = self.objects.pop(key)
        if obj.state == PUBLISHED:
            del self.lru[key]
            self.published_bytes -= obj.size
            for p in obj.placements:  # (a segment already gone took its counts with it)
                p.seg.objects -= 1
                p.seg.object_bytes -= obj.size
        self._retire(obj.placements, free_at, now)

    def _retire(self, extents: list[Placement], free_at: int, now: int) -> None:
        if free_at <= now:
            self._free(extents, counted=False)
        elif extents:
            self.quarantine.hold(extents, free_at, sum(p.alloc_size for p in extents if self.table.live(p)))

    def _free(self, extents: list[Placement], counted: bool) -> None:
        for p in extents:
            if self.table.live(p):  # a segment that went away took its extents with it
                p.seg.alloc.free(p.offset, p.alloc_size)
                if counted:
                    self.quarantine.bytes -= p.alloc_size

    def _do_mount(self, node_id: str, host: str, port: int, host_id: str, segs: Sequence[SegSpec],
                  now: int) -> None:
        node, stale = self.table.touch(node_id, host, port, host_id, segs, now)
        if stale:  # same id, new memory: everything on the old memory is gone
            self._do_unmount(node_id, stale, now)
        self.table.add(node, segs)

    def _do_unmount(self, node_id: str, sids: list[int] | None, now: int) -> None:
        lost = self.table.remove(node_id, sids)
        self.quarantine.forget(lost)
        gone = {id(seg) for seg in lost}
        grace = self._to_ms(self.cfg.grace_s)
        for obj in list(self.objects.values()):
            if not any(id(p.seg) in gone for p in obj.placements):
                continue
            obj.placements = [p for p in obj.placements if id(p.seg) not in gone]
            if obj.state == PENDING or not obj.placements:  # no partial puts, no empty objects
                self._do_delete(obj.key, max(obj.lease_until_ms, obj.write_expiry_ms) + grace, now)
                self.counters["objects_lost"] += 1
        # An arena that lost a replica goes whole (like a PENDING put); its extents on the gone
        # segments are skipped by _retire/_free, the rest waits out the arena's tokens.
        for arena in [a for a in self.arenas.values() if any(id(p.seg) in gone for p in a.placements)]:
            self._do_arena_release(arena.arena_id, arena.write_expiry_ms + grace, now)
            self.counters["arenas_lost"] += 1

    # -- stats -------------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        hits, misses = self.counters["hits"], self.counters["misses"]
        return {
            "objects": len(self.lru), "pending_puts": len(self.objects) - len(self.lru),
            "object_bytes": self.published_bytes, "used_bytes": self.used(),
            "capacity_bytes": self.capacity(), "quarantined_bytes": self.quarantined_bytes,
            "nodes": len(self.nodes), "segments": len(self.segments()), "arenas": len(self.arenas),
            "hits": hits, "misses": misses,
            "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
            "evictions": self.counters["evictions"], **{k: v for k, v in self.counters.items()
                                                        if k not in ("hits", "misses", "evictions")},
        }


def _item(item: ArenaItem) -> tuple[str, int, int, bytes]:
    """(key, offset, size[, mac]) -> with the object MAC (b"" when the writer sent none)."""
    return (item[0], item[1], item[2], item[3] if len(item) > 3 else b"")  # type: ignore[misc]


def encode_placement(p: Placement) -> list[Any]:
    return [p.seg.node_id, p.seg.segment_id, p.seg.incarnation, p.offset]
