"""Master-side records: config, nodes, segments, placements, objects, status codes.

    key -> Obj -> [Placement] -> Segment (node_id, segment_id, incarnation) -> ExtentAllocator

A segment's `incarnation` is random per allocation of its memory: a node that restarts (and so
lost its memory) comes back with new incarnations, which invalidates every placement on the old
ones. Placements reference their Segment object, so `node.segments[sid] is placement.seg` tells
whether the memory they point at still exists.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .allocator import ExtentAllocator


class Status(enum.IntEnum):
    """Mirrors pdcluster.v1.KVStatus."""

    OK = 0
    NOT_FOUND = 1
    ALREADY_EXISTS = 2
    IN_PROGRESS = 3
    NO_SPACE = 4
    INVALID = 5
    UNKNOWN_NODE = 6
    TRANSFER_FAILED = 7  # client side only: the bytes could not be written; the put was revoked


@dataclass(frozen=True)
class MasterConfig:
    lease_ttl_s: float = 5.0  # read lease (and read-token lifetime) per get
    # Write-token lifetime; an unfinished put is reclaimed after it. Also the shortest time before
    # a just-written object's bytes can be reused (a valid write token could still touch them).
    put_timeout_s: float = 10.0
    grace_s: float = 2.0  # clock skew + longest in-flight transfer; added before reusing space
    high_watermark: float = 0.95  # start evicting above this fraction of capacity
    low_watermark: float = 0.85  # ... down to this
    node_timeout_s: float = 10.0  # no heartbeat for this long: node and its segments are dropped
    align: int = 256
    max_key_len: int = 1024
    max_batch: int = 4096
    max_object_size: int = 1 << 34
    max_replicas: int = 8
    # A write arena is at most this fraction of a segment: arenas are speculative space that
    # eviction cannot touch, so in a small store they must not crowd out the objects.
    arena_max_fraction: float = 1 / 16

    def __post_init__(self) -> None:
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise ValueError("need 0 < low_watermark <= high_watermark <= 1")
        if min(self.lease_ttl_s, self.put_timeout_s, self.node_timeout_s) <= 0 or self.grace_s < 0:
            raise ValueError("timeouts must be positive")
        if not 0 < self.arena_max_fraction <= 1:
            raise ValueError("need 0 < arena_max_fraction <= 1")


@dataclass(eq=False)
class Segment:
    node_id: str
    segment_id: int
    size: int
    shm_name: str
    incarnation: int
    alloc: ExtentAllocator
    objects: int = 0  # published objects with a replica here (MetadataStore._do_publish/_do_delete)
    object_bytes: int = 0


@dataclass(eq=False)
class Node:
    node_id: str
    data_host: str
    data_port: int
    host_id: str
    last_seen_ms: int
    segments: dict[int, Segment] = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class Placement:
    seg: Segment
    offset: int
    alloc_size: int  # the extent taken from the allocator (size rounded up)


PENDING = "pending"
PUBLISHED = "published"


@dataclass(eq=False)
class Obj:
    key: str
    size: int
    placements: list[Placement]
    state: str  # PENDING until put_end, then PUBLISHED (immutable until removed)
    put_id: str
    pinned: bool
    write_expiry_ms: int  # write tokens for this object die here
    lease_until_ms: int = 0  # read tokens die here; nothing frees the bytes before it (+ grace)
    mac: bytes = b""  # the writer's object MAC (object_mac.py), recorded at publish, checked by readers
