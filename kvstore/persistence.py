"""Snapshot (de)serialisation and op-log replay for MetadataStore.

Replay calls the same primitives the live operations call, so recovered state equals the state
the log describes. Records come from our own CRC-checked files, but every field is still
type-checked: a bad one raises OpLogCorrupt instead of producing a half-built store.

After replay (`finish_recovery`):
- PENDING puts are dropped (their bytes quarantined until their write tokens expire);
- every object is treated as leased for one lease period, because read tokens issued before
  the crash may still be valid;
- every node gets a full node_timeout to heartbeat before it is declared dead;
- arenas stay as they were: their space is reserved (and commits into them accepted) until their
  fixed expiry, then tick() quarantines the rest until expiry + grace, as without the restart.
"""

from __future__ import annotations

from typing import Any

from .entities import PENDING, PUBLISHED, Placement
from .metadata import MetadataStore, encode_placement
from .oplog import OpLogCorrupt

SNAPSHOT_VERSION = 2  # 2 added arenas; 1 (no arenas) still loads


def _placements(store: MetadataStore, raw: Any, size: int | None, alloc_sizes: list[int] | None = None,
                reserve: bool = True) -> list[Placement]:
    out = []
    for i, item in enumerate(raw):
        node_id, sid, inc, off = item[:4]
        node = store.nodes.get(node_id)
        seg = node.segments.get(sid) if node else None
        if seg is None or seg.incarnation != inc:
            raise OpLogCorrupt(f"placement on unknown segment {node_id}/{sid}")
        asize = alloc_sizes[i] if alloc_sizes is not None else seg.alloc.round(int(size or 0))
        if reserve:
            seg.alloc.reserve(int(off), asize)
        out.append(Placement(seg, int(off), asize))
    return out


def apply_record(store: MetadataStore, rec: dict[str, Any], now: int) -> None:
    try:
        operation = rec["op"]
        if operation == "mount":
            segs = [(int(s[0]), int(s[1]), str(s[2]), int(s[3])) for s in rec["segs"]]
            store._do_mount(str(rec["node"]), str(rec["host"]), int(rec["port"]), str(rec["host_id"]), segs, now)
        elif operation == "unmount":
            if rec["node"] in store.nodes:
                sids = rec["sids"]
                store._do_unmount(str(rec["node"]), None if sids is None else [int(s) for s in sids], now)
        elif operation == "start":
            size = int(rec["size"])
            placements = _placements(store, rec["pl"], size)
            store._do_start(str(rec["key"]), size, str(rec["put_id"]), bool(rec["pinned"]), int(rec["wexp"]), placements)
        elif operation == "put":
            store._do_publish(str(rec["key"]), bytes(rec.get("mac") or b""))
        elif operation == "arena":
            placements = _placements(store, rec["pl"], None, [int(e[4]) for e in rec["pl"]])
            store._do_arena_reserve(str(rec["id"]), int(rec["wexp"]), placements)
        elif operation == "acommit":
            if rec["id"] not in store.arenas:
                raise OpLogCorrupt(f"commit into unknown arena {rec['id']!r}")
            # [key, offset, size] before object MACs, [key, offset, size, mac] since
            items = [(str(it[0]), int(it[1]), int(it[2]), bytes(it[3]) if len(it) > 3 else b"")
                     for it in rec["items"]]
            store._do_arena_commit(str(rec["id"]), items, bool(rec["pinned"]))
        elif operation == "arel":
            if rec["id"] in store.arenas:  # may already be gone with its segment
                store._do_arena_release(str(rec["id"]), int(rec["free_at"]), now)
        elif operation == "del":
            if rec["key"] in store.objects:  # may already be gone with its segment
                store._do_delete(str(rec["key"]), int(rec["free_at"]), now)
        else:
            raise OpLogCorrupt(f"unknown op {operation!r}")
    except OpLogCorrupt:
        raise
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise OpLogCorrupt(f"bad record {rec.get('op')!r}: {e}") from e


def snapshot_state(store: MetadataStore) -> dict[str, Any]:
    nodes = [[n.node_id, n.data_host, n.data_port, n.host_id,
              [[s.segment_id, s.size, s.shm_name, s.incarnation] for s in n.segments.values()]]
             for n in store.nodes.values()]
    # Published objects in LRU order so eviction order survives a restart; pending ones after.
    order = list(store.lru) + [k for k, o in store.objects.items() if o.state == PENDING]
    objects = []
    for key in order:
        o = store.objects[key]
        objects.append([o.key, o.size, o.state, o.put_id, o.pinned, o.write_expiry_ms,
                        [encode_placement(p) for p in o.placements], o.mac])
    quarantine = [[free_at, [encode_placement(p) + [p.alloc_size] for p in ext if store.table.live(p)]]
                  for free_at, _, ext in store.quarantine.heap]
    arenas = [[a.arena_id, a.write_expiry_ms, [encode_placement(p) + [p.alloc_size] for p in a.placements],
               [list(r) for r in a.taken()]] for a in store.arenas.values()]
    return {"version": SNAPSHOT_VERSION, "nodes": nodes, "objects": objects, "quarantine": quarantine,
            "arenas": arenas}


def load_snapshot(store: MetadataStore, snap: dict[str, Any], now: int) -> None:
    try:
        if snap.get("version") not in (1, SNAPSHOT_VERSION):
            raise OpLogCorrupt(f"unsupported snapshot version {snap.get('version')!r}")
        for node_id, host, port, host_id, segs in snap["nodes"]:
            specs = [(int(s[0]), int(s[1]), str(s[2]), int(s[3])) for s in segs]
            store._do_mount(str(node_id), str(host), int(port), str(host_id), specs, now)
        for key, size, state, put_id, pinned, wexp, placements, *rest in snap["objects"]:  # rest: [mac]
            store._do_start(str(key), int(size), str(put_id), bool(pinned), int(wexp),
                            _placements(store, placements, int(size)))
            if state == PUBLISHED:
                store._do_publish(str(key), bytes(rest[0]) if rest else b"")
        for free_at, ext in snap["quarantine"]:
            placements = _placements(store, ext, None, [int(e[4]) for e in ext])
            store._retire(placements, int(free_at), now)
        for arena_id, wexp, placements, taken in snap.get("arenas", []):
            # The arena owns only what no object took (those ranges were reserved by their objects
            # or their quarantine above): reserve exactly that.
            store._do_arena_reserve(str(arena_id), int(wexp),
                                    _placements(store, placements, None, [int(e[4]) for e in placements], reserve=False))
            arena = store.arenas[str(arena_id)]
            for start, end in taken:
                arena.take(int(start), int(end) - int(start))
            for p in arena.owned_extents():
                p.seg.alloc.reserve(p.offset, p.alloc_size)
    except OpLogCorrupt:
        raise
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise OpLogCorrupt(f"bad snapshot: {e}") from e


def finish_recovery(store: MetadataStore, now: int) -> None:
    grace = store._to_ms(store.cfg.grace_s)
    for obj in [o for o in store.objects.values() if o.state == PENDING]:
        store._do_delete(obj.key, obj.write_expiry_ms + grace, now)
    lease = now + store._to_ms(store.cfg.lease_ttl_s)
    for obj in store.objects.values():
        obj.lease_until_ms = max(obj.lease_until_ms, lease)
    for node in store.nodes.values():
        node.last_seen_ms = now
    store.quarantine.reorder()
