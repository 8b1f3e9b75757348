from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_OK: _ClassVar[KVStatus]
    KV_NOT_FOUND: _ClassVar[KVStatus]
    KV_ALREADY_EXISTS: _ClassVar[KVStatus]
    KV_IN_PROGRESS: _ClassVar[KVStatus]
    KV_NO_SPACE: _ClassVar[KVStatus]
    KV_INVALID: _ClassVar[KVStatus]
    KV_UNKNOWN_NODE: _ClassVar[KVStatus]
    KV_TRANSFER_FAILED: _ClassVar[KVStatus]
KV_OK: KVStatus
KV_NOT_FOUND: KVStatus
KV_ALREADY_EXISTS: KVStatus
KV_IN_PROGRESS: KVStatus
KV_NO_SPACE: KVStatus
KV_INVALID: KVStatus
KV_UNKNOWN_NODE: KVStatus
KV_TRANSFER_FAILED: KVStatus

class KVReplica(_message.Message):
    __slots__ = ("node_id", "segment_id", "data_host", "data_port", "host_id", "shm_name", "segment_size", "offset", "size", "token")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_HOST_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_SIZE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    segment_id: int
    data_host: str
    data_port: int
    host_id: str
    shm_name: str
    segment_size: int
    offset: int
    size: int
    token: bytes
    def __init__(self, node_id: _Optional[str] = ..., segment_id: _Optional[int] = ..., data_host: _Optional[str] = ..., data_port: _Optional[int] = ..., host_id: _Optional[str] = ..., shm_name: _Optional[str] = ..., segment_size: _Optional[int] = ..., offset: _Optional[int] = ..., size: _Optional[int] = ..., token: _Optional[bytes] = ...) -> None: ...

class KVPutItem(_message.Message):
    __slots__ = ("key", "size")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    key: str
    size: int
    def __init__(self, key: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class KVPutStartRequest(_message.Message):
    __slots__ = ("items", "replica_num", "pinned")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_NUM_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[KVPutItem]
    replica_num: int
    pinned: bool
    def __init__(self, items: _Optional[_Iterable[_Union[KVPutItem, _Mapping]]] = ..., replica_num: _Optional[int] = ..., pinned: _Optional[bool] = ...) -> None: ...

class KVPutStartResult(_message.Message):
    __slots__ = ("key", "status", "put_id", "replicas", "token_expiry_ms")
    KEY_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    PUT_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_EXPIRY_MS_FIELD_NUMBER: _ClassVar[int]
    key: str
    status: KVStatus
    put_id: str
    replicas: _containers.RepeatedCompositeFieldContainer[KVReplica]
    token_expiry_ms: int
    def __init__(self, key: _Optional[str] = ..., status: _Optional[_Union[KVStatus, str]] = ..., put_id: _Optional[str] = ..., replicas: _Optional[_Iterable[_Union[KVReplica, _Mapping]]] = ..., token_expiry_ms: _Optional[int] = ...) -> None: ...

class KVPutStartResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[KVPutStartResult]
    def __init__(self, results: _Optional[_Iterable[_Union[KVPutStartResult, _Mapping]]] = ...) -> None: ...

class KVPutRef(_message.Message):
    __slots__ = ("key", "put_id", "mac")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PUT_ID_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    key: str
    put_id: str
    mac: bytes
    def __init__(self, key: _Optional[str] = ..., put_id: _Optional[str] = ..., mac: _Optional[bytes] = ...) -> None: ...

class KVPutEndRequest(_message.Message):
    __slots__ = ("puts",)
    PUTS_FIELD_NUMBER: _ClassVar[int]
    puts: _containers.RepeatedCompositeFieldContainer[KVPutRef]
    def __init__(self, puts: _Optional[_Iterable[_Union[KVPutRef, _Mapping]]] = ...) -> None: ...

class KVPutEndResponse(_message.Message):
    __slots__ = ("statuses",)
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    statuses: _containers.RepeatedScalarFieldContainer[KVStatus]
    def __init__(self, statuses: _Optional[_Iterable[_Union[KVStatus, str]]] = ...) -> None: ...

class KVPutRevokeRequest(_message.Message):
    __slots__ = ("puts",)
    PUTS_FIELD_NUMBER: _ClassVar[int]
    puts: _containers.RepeatedCompositeFieldContainer[KVPutRef]
    def __init__(self, puts: _Optional[_Iterable[_Union[KVPutRef, _Mapping]]] = ...) -> None: ...

class KVPutRevokeResponse(_message.Message):
    __slots__ = ("statuses",)
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    statuses: _containers.RepeatedScalarFieldContainer[KVStatus]
    def __init__(self, statuses: _Optional[_Iterable[_Union[KVStatus, str]]] = ...) -> None: ...

class KVReserveArenaRequest(_message.Message):
    __slots__ = ("size", "replica_num")
    SIZE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_NUM_FIELD_NUMBER: _ClassVar[int]
    size: int
    replica_num: int
    def __init__(self, size: _Optional[int] = ..., replica_num: _Optional[int] = ...) -> None: ...

class KVReserveArenaResponse(_message.Message):
    __slots__ = ("status", "arena_id", "size", "align", "replicas", "token_expiry_ms")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ARENA_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    ALIGN_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_EXPIRY_MS_FIELD_NUMBER: _ClassVar[int]
    status: KVStatus
    arena_id: str
    size: int
    align: int
    replicas: _containers.RepeatedCompositeFieldContainer[KVReplica]
    token_expiry_ms: int
    def __init__(self, status: _Optional[_Union[KVStatus, str]] = ..., arena_id: _Optional[str] = ..., size: _Optional[int] = ..., align: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[KVReplica, _Mapping]]] = ..., token_expiry_ms: _Optional[int] = ...) -> None: ...

class KVArenaItem(_message.Message):
    __slots__ = ("key", "offset", "size", "mac")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    key: str
    offset: int
    size: int
    mac: bytes
    def __init__(self, key: _Optional[str] = ..., offset: _Optional[int] = ..., size: _Optional[int] = ..., mac: _Optional[bytes] = ...) -> None: ...

class KVCommitArenaRequest(_message.Message):
    __slots__ = ("arena_id", "items", "pinned")
    ARENA_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    arena_id: str
    items: _containers.RepeatedCompositeFieldContainer[KVArenaItem]
    pinned: bool
    def __init__(self, arena_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[KVArenaItem, _Mapping]]] = ..., pinned: _Optional[bool] = ...) -> None: ...

class KVCommitArenaResponse(_message.Message):
    __slots__ = ("status", "statuses")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    status: KVStatus
    statuses: _containers.RepeatedScalarFieldContainer[KVStatus]
    def __init__(self, status: _Optional[_Union[KVStatus, str]] = ..., statuses: _Optional[_Iterable[_Union[KVStatus, str]]] = ...) -> None: ...

class KVReleaseArenaRequest(_message.Message):
    __slots__ = ("arena_id",)
    ARENA_ID_FIELD_NUMBER: _ClassVar[int]
    arena_id: str
    def __init__(self, arena_id: _Optional[str] = ...) -> None: ...

class KVReleaseArenaResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: KVStatus
    def __init__(self, status: _Optional[_Union[KVStatus, str]] = ...) -> None: ...

class KVGetReplicasRequest(_message.Message):
    __slots__ = ("keys", "shm_host_id")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SHM_HOST_ID_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    shm_host_id: str
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., shm_host_id: _Optional[str] = ...) -> None: ...

class KVGetReplicasResult(_message.Message):
    __slots__ = ("key", "status", "size", "replicas", "lease_expiry_ms", "mac")
    KEY_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRY_MS_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    key: str
    status: KVStatus
    size: int
    replicas: _containers.RepeatedCompositeFieldContainer[KVReplica]
    lease_expiry_ms: int
    mac: bytes
    def __init__(self, key: _Optional[str] = ..., status: _Optional[_Union[KVStatus, str]] = ..., size: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[KVReplica, _Mapping]]] = ..., lease_expiry_ms: _Optional[int] = ..., mac: _Optional[bytes] = ...) -> None: ...

class KVGetReplicasResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[KVGetReplicasResult]
    def __init__(self, results: _Optional[_Iterable[_Union[KVGetReplicasResult, _Mapping]]] = ...) -> None: ...

class KVOpenLookupRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVOpenLookupResponse(_message.Message):
    __slots__ = ("path", "ticket", "expiry_ms", "host_id")
    PATH_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    EXPIRY_MS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    path: str
    ticket: bytes
    expiry_ms: int
    host_id: str
    def __init__(self, path: _Optional[str] = ..., ticket: _Optional[bytes] = ..., expiry_ms: _Optional[int] = ..., host_id: _Optional[str] = ...) -> None: ...

class KVExistsRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class KVExistsResponse(_message.Message):
    __slots__ = ("exists",)
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    exists: bool
    def __init__(self, exists: _Optional[bool] = ...) -> None: ...

class KVBatchExistsRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class KVBatchExistsResponse(_message.Message):
    __slots__ = ("exists",)
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    exists: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, exists: _Optional[_Iterable[bool]] = ...) -> None: ...

class KVRemoveRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class KVRemoveResponse(_message.Message):
    __slots__ = ("statuses",)
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    statuses: _containers.RepeatedScalarFieldContainer[KVStatus]
    def __init__(self, statuses: _Optional[_Iterable[_Union[KVStatus, str]]] = ...) -> None: ...

class KVSegmentInfo(_message.Message):
    __slots__ = ("segment_id", "size", "shm_name", "incarnation")
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    segment_id: int
    size: int
    shm_name: str
    incarnation: int
    def __init__(self, segment_id: _Optional[int] = ..., size: _Optional[int] = ..., shm_name: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class KVMountSegmentRequest(_message.Message):
    __slots__ = ("node_id", "data_host", "data_port", "host_id", "segments")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_HOST_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    data_host: str
    data_port: int
    host_id: str
    segments: _containers.RepeatedCompositeFieldContainer[KVSegmentInfo]
    def __init__(self, node_id: _Optional[str] = ..., data_host: _Optional[str] = ..., data_port: _Optional[int] = ..., host_id: _Optional[str] = ..., segments: _Optional[_Iterable[_Union[KVSegmentInfo, _Mapping]]] = ...) -> None: ...

class KVMountSegmentResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: KVStatus
    def __init__(self, status: _Optional[_Union[KVStatus, str]] = ...) -> None: ...

class KVUnmountSegmentRequest(_message.Message):
    __slots__ = ("node_id", "segment_ids")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_IDS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    segment_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, node_id: _Optional[str] = ..., segment_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class KVUnmountSegmentResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: KVStatus
    def __init__(self, status: _Optional[_Union[KVStatus, str]] = ...) -> None: ...

class KVHeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "segments")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    segments: _containers.RepeatedCompositeFieldContainer[KVSegmentInfo]
    def __init__(self, node_id: _Optional[str] = ..., segments: _Optional[_Iterable[_Union[KVSegmentInfo, _Mapping]]] = ...) -> None: ...

class KVHeartbeatResponse(_message.Message):
    __slots__ = ("status", "used_bytes", "objects", "object_bytes")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    OBJECT_BYTES_FIELD_NUMBER: _ClassVar[int]
    status: KVStatus
    used_bytes: int
    objects: int
    object_bytes: int
    def __init__(self, status: _Optional[_Union[KVStatus, str]] = ..., used_bytes: _Optional[int] = ..., objects: _Optional[int] = ..., object_bytes: _Optional[int] = ...) -> None: ...

class KVStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVStatsResponse(_message.Message):
    __slots__ = ("objects", "pending_puts", "object_bytes", "used_bytes", "capacity_bytes", "nodes", "segments", "hits", "misses", "hit_rate", "evictions", "counters")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    PENDING_PUTS_FIELD_NUMBER: _ClassVar[int]
    OBJECT_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    objects: int
    pending_puts: int
    object_bytes: int
    used_bytes: int
    capacity_bytes: int
    nodes: int
    segments: int
    hits: int
    misses: int
    hit_rate: float
    evictions: int
    counters: _containers.ScalarMap[str, float]
    def __init__(self, objects: _Optional[int] = ..., pending_puts: _Optional[int] = ..., object_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., nodes: _Optional[int] = ..., segments: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., hit_rate: _Optional[float] = ..., evictions: _Optional[int] = ..., counters: _Optional[_Mapping[str, float]] = ...) -> None: ...

class KVFollowRequest(_message.Message):
    __slots__ = ("follower_id", "epoch")
    FOLLOWER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    follower_id: str
    epoch: int
    def __init__(self, follower_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class KVOpLogEntry(_message.Message):
    __slots__ = ("epoch", "seq", "kind", "payload", "more")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        RECORD: _ClassVar[KVOpLogEntry.Kind]
        SNAPSHOT: _ClassVar[KVOpLogEntry.Kind]
        HEARTBEAT: _ClassVar[KVOpLogEntry.Kind]
    RECORD: KVOpLogEntry.Kind
    SNAPSHOT: KVOpLogEntry.Kind
    HEARTBEAT: KVOpLogEntry.Kind
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    seq: int
    kind: KVOpLogEntry.Kind
    payload: bytes
    more: bool
    def __init__(self, epoch: _Optional[int] = ..., seq: _Optional[int] = ..., kind: _Optional[_Union[KVOpLogEntry.Kind, str]] = ..., payload: _Optional[bytes] = ..., more: _Optional[bool] = ...) -> None: ...

class KVAckRequest(_message.Message):
    __slots__ = ("follower_id", "seq", "epoch")
    FOLLOWER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    follower_id: str
    seq: int
    epoch: int
    def __init__(self, follower_id: _Optional[str] = ..., seq: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class KVAckResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: KVStatus
    def __init__(self, status: _Optional[_Union[KVStatus, str]] = ...) -> None: ...

class KVRoleRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVRoleResponse(_message.Message):
    __slots__ = ("primary", "epoch", "primary_address")
    PRIMARY_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    primary: bool
    epoch: int
    primary_address: str
    def __init__(self, primary: _Optional[bool] = ..., epoch: _Optional[int] = ..., primary_address: _Optional[str] = ...) -> None: ...
