from . import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProvideKVParamsRequest(_message.Message):
    __slots__ = ("request_id", "transfer_id", "kv_transfer_params", "prefill_output_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_id: str
    kv_transfer_params: _common_pb2.KvTransferParams
    prefill_output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., kv_transfer_params: _Optional[_Union[_common_pb2.KvTransferParams, _Mapping]] = ..., prefill_output_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ProvideKVParamsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("request_id", "images")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    images: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, request_id: _Optional[str] = ..., images: _Optional[_Iterable[bytes]] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("ec_transfer_params",)
    EC_TRANSFER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    ec_transfer_params: _common_pb2.EcTransferParams
    def __init__(self, ec_transfer_params: _Optional[_Union[_common_pb2.EcTransferParams, _Mapping]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("timeout_s",)
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    timeout_s: float
    def __init__(self, timeout_s: _Optional[float] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("num_finished", "num_moved")
    NUM_FINISHED_FIELD_NUMBER: _ClassVar[int]
    NUM_MOVED_FIELD_NUMBER: _ClassVar[int]
    num_finished: int
    num_moved: int
    def __init__(self, num_finished: _Optional[int] = ..., num_moved: _Optional[int] = ...) -> None: ...

class WorkerGenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "kv_transfer_params", "stream", "eos_token_ids", "prefill_output_token_ids", "images", "ec_transfer_params", "await_kv_transfer_id", "kv_params_timeout_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    EC_TRANSFER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    AWAIT_KV_TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_PARAMS_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _common_pb2.SamplingParams
    kv_transfer_params: _common_pb2.KvTransferParams
    stream: bool
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prefill_output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    images: _containers.RepeatedScalarFieldContainer[bytes]
    ec_transfer_params: _containers.RepeatedCompositeFieldContainer[_common_pb2.EcTransferParams]
    await_kv_transfer_id: str
    kv_params_timeout_s: float
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., kv_transfer_params: _Optional[_Union[_common_pb2.KvTransferParams, _Mapping]] = ..., stream: _Optional[bool] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., prefill_output_token_ids: _Optional[_Iterable[int]] = ..., images: _Optional[_Iterable[bytes]] = ..., ec_transfer_params: _Optional[_Iterable[_Union[_common_pb2.EcTransferParams, _Mapping]]] = ..., await_kv_transfer_id: _Optional[str] = ..., kv_params_timeout_s: _Optional[float] = ...) -> None: ...

class WorkerGenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "logprobs", "token_arrival_times", "finished", "finish_reason", "stop_token_id", "stop_str", "usage", "error_message", "kv_transfer_params", "stream_tag", "ec_transfer_params", "prompt_logprobs", "error_field")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ARRIVAL_TIMES_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_STR_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    STREAM_TAG_FIELD_NUMBER: _ClassVar[int]
    EC_TRANSFER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.SampleLogprobs]
    token_arrival_times: _containers.RepeatedScalarFieldContainer[float]
    finished: bool
    finish_reason: _common_pb2.FinishReason
    stop_token_id: int
    stop_str: str
    usage: _common_pb2.Usage
    error_message: str
    kv_transfer_params: _common_pb2.KvTransferParams
    stream_tag: int
    ec_transfer_params: _common_pb2.EcTransferParams
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.SampleLogprobs]
    error_field: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.SampleLogprobs, _Mapping]]] = ..., token_arrival_times: _Optional[_Iterable[float]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., stop_str: _Optional[str] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., error_message: _Optional[str] = ..., kv_transfer_params: _Optional[_Union[_common_pb2.KvTransferParams, _Mapping]] = ..., stream_tag: _Optional[int] = ..., ec_transfer_params: _Optional[_Union[_common_pb2.EcTransferParams, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.SampleLogprobs, _Mapping]]] = ..., error_field: _Optional[str] = ...) -> None: ...

class StreamGenerate(_message.Message):
    __slots__ = ("request", "timeout_s", "tag")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    request: WorkerGenerateRequest
    timeout_s: float
    tag: int
    def __init__(self, request: _Optional[_Union[WorkerGenerateRequest, _Mapping]] = ..., timeout_s: _Optional[float] = ..., tag: _Optional[int] = ...) -> None: ...

class WorkerStreamRequest(_message.Message):
    __slots__ = ("generate", "abort_tags")
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    ABORT_TAGS_FIELD_NUMBER: _ClassVar[int]
    generate: _containers.RepeatedCompositeFieldContainer[StreamGenerate]
    abort_tags: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, generate: _Optional[_Iterable[_Union[StreamGenerate, _Mapping]]] = ..., abort_tags: _Optional[_Iterable[int]] = ...) -> None: ...

class StreamError(_message.Message):
    __slots__ = ("request_id", "code", "message", "tag")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    code: int
    message: str
    tag: int
    def __init__(self, request_id: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., tag: _Optional[int] = ...) -> None: ...

class WorkerStreamResponse(_message.Message):
    __slots__ = ("deltas", "errors")
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    deltas: _containers.RepeatedCompositeFieldContainer[WorkerGenerateResponse]
    errors: _containers.RepeatedCompositeFieldContainer[StreamError]
    def __init__(self, deltas: _Optional[_Iterable[_Union[WorkerGenerateResponse, _Mapping]]] = ..., errors: _Optional[_Iterable[_Union[StreamError, _Mapping]]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "role", "model", "dtype", "kv_cache_dtype", "block_size", "max_model_len", "tp_size", "num_kv_blocks_total", "kv_connector", "engine_epoch", "version", "kv_events_endpoint", "kv_snapshot_endpoint", "kv_events_public_key", "eos_token_ids", "ec_connector", "ec_endpoint", "ec_public_key")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_CONNECTOR_FIELD_NUMBER: _ClassVar[int]
    ENGINE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    KV_SNAPSHOT_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EC_CONNECTOR_FIELD_NUMBER: _ClassVar[int]
    EC_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    EC_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: _common_pb2.WorkerRole
    model: str
    dtype: str
    kv_cache_dtype: str
    block_size: int
    max_model_len: int
    tp_size: int
    num_kv_blocks_total: int
    kv_connector: str
    engine_epoch: int
    version: str
    kv_events_endpoint: str
    kv_snapshot_endpoint: str
    kv_events_public_key: bytes
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ec_connector: str
    ec_endpoint: str
    ec_public_key: bytes
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.WorkerRole, str]] = ..., model: _Optional[str] = ..., dtype: _Optional[str] = ..., kv_cache_dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., tp_size: _Optional[int] = ..., num_kv_blocks_total: _Optional[int] = ..., kv_connector: _Optional[str] = ..., engine_epoch: _Optional[int] = ..., version: _Optional[str] = ..., kv_events_endpoint: _Optional[str] = ..., kv_snapshot_endpoint: _Optional[str] = ..., kv_events_public_key: _Optional[bytes] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., ec_connector: _Optional[str] = ..., ec_endpoint: _Optional[str] = ..., ec_public_key: _Optional[bytes] = ...) -> None: ...
