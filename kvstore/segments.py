"""SegmentTable: the storage nodes the master knows, their segments, and where an object can go.

Pure bookkeeping under MetadataStore's lock (no I/O, no clock): mounting adds a node's segments,
`place` picks extents for a new object or arena, `live` tells whether an extent's segment is still
the one it was taken from. What an object or arena loses with a segment is MetadataStore's rule.
"""

from __future__ import annotations

from collections.abc import Sequence

from .allocator import ExtentAllocator
from .entities import Node, Placement, Segment, Status

SegSpec = tuple[int, int, str, int]  # segment_id, size, shm_name, incarnation


class SegmentTable:
    def __init__(self, align: int) -> None:
        self.nodes: dict[str, Node] = {}
        self._align = align

    def segments(self) -> list[Segment]:
        return [s for n in self.nodes.values() for s in n.segments.values()]

    def capacity(self) -> int:
        return sum(s.alloc.capacity for s in self.segments())

    def used(self) -> int:
        return sum(s.alloc.used for s in self.segments())

    def place(self, size: int, replica_num: int) -> list[Placement]:
        """Best effort: up to replica_num extents on distinct nodes, emptiest segments first."""
        out: list[Placement] = []
        nodes_used: set[str] = set()
        for seg in sorted(self.segments(), key=lambda s: s.alloc.free_bytes, reverse=True):
            if seg.node_id in nodes_used or seg.alloc.free_bytes < size:
                continue
            offset = seg.alloc.alloc(size)
            if offset is not None:
                out.append(Placement(seg, offset, seg.alloc.round(size)))
                nodes_used.add(seg.node_id)
                if len(out) == replica_num:
                    break
        return out

    def live(self, p: Placement) -> bool:
        """The extent's segment is still mounted (a segment that went away took its extents)."""
        node = self.nodes.get(p.seg.node_id)
        return node is not None and node.segments.get(p.seg.segment_id) is p.seg

    def usage(self, node_id: str) -> tuple[int, int, int]:
        """(bytes allocated, published objects, their bytes) in the node's segments."""
        segs = self.nodes[node_id].segments.values()
        return (sum(s.alloc.used for s in segs), sum(s.objects for s in segs), sum(s.object_bytes for s in segs))

    def heartbeat(self, node_id: str, segs: Sequence[tuple[int, int]], now: int) -> Status:
        """segs: (segment_id, incarnation). UNKNOWN_NODE tells the node to mount (again)."""
        node = self.nodes.get(node_id)
        if node is None:
            return Status.UNKNOWN_NODE
        for sid, incarnation in segs:
            seg = node.segments.get(sid)
            if seg is None or seg.incarnation != incarnation:
                return Status.UNKNOWN_NODE
        node.last_seen_ms = now
        return Status.OK

    def touch(self, node_id: str, host: str, port: int, host_id: str, segs: Sequence[SegSpec],
              now: int) -> tuple[Node, list[int]]:
        """Create or refresh the node; returns it and the ids of its segments whose memory is new
        (same id, other incarnation or size): the caller unmounts those before `add`."""
        node = self.nodes.get(node_id)
        if node is None:
            node = self.nodes[node_id] = Node(node_id, host, port, host_id, now)
        node.data_host, node.data_port, node.host_id, node.last_seen_ms = host, port, host_id, now
        stale = [sid for sid, size, _, incarnation in segs
                 if sid in node.segments and (node.segments[sid].incarnation, node.segments[sid].size) != (incarnation, size)]
        return node, stale

    def add(self, node: Node, segs: Sequence[SegSpec]) -> None:
        """Mount the segments the node does not have yet (it is re-added if unmounting emptied it)."""
        node = self.nodes.setdefault(node.node_id, node)
        for sid, size, shm, incarnation in segs:
            if sid not in node.segments:
                node.segments[sid] = Segment(node.node_id, sid, size, shm, incarnation,
                                             ExtentAllocator(size, self._align))

    def remove(self, node_id: str, sids: list[int] | None) -> list[Segment]:
        """Unmount the node's segments `sids` (None: all, and the node); returns those removed.
        The node goes too once it has no segment left."""
        node = self.nodes[node_id]
        lost = [node.segments.pop(sid) for sid in list(node.segments) if sids is None or sid in sids]
        if sids is None or not node.segments:
            del self.nodes[node_id]
        return lost


__all__ = ["SegSpec", "SegmentTable"]
