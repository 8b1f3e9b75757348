from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]
    WORKER_ROLE_BOTH: _ClassVar[WorkerRole]
    WORKER_ROLE_ENCODE: _ClassVar[WorkerRole]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole
WORKER_ROLE_BOTH: WorkerRole
WORKER_ROLE_ENCODE: WorkerRole
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "stop", "stop_token_ids", "include_stop_str_in_output", "max_tokens", "min_tokens", "ignore_eos", "logprobs", "skip_special_tokens", "detokenize", "structured_outputs", "logit_bias", "prompt_logprobs", "cache_salt", "truncate_prompt_tokens", "allowed_token_ids", "bad_words", "priority")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    N_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DETOKENIZE_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    n: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    include_stop_str_in_output: bool
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    logprobs: int
    skip_special_tokens: bool
    detokenize: bool
    structured_outputs: StructuredOutputs
    logit_bias: _containers.ScalarMap[int, float]
    prompt_logprobs: int
    cache_salt: str
    truncate_prompt_tokens: int
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    priority: int
    def __init__(self, n: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., include_stop_str_in_output: _Optional[bool] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., skip_special_tokens: _Optional[bool] = ..., detokenize: _Optional[bool] = ..., structured_outputs: _Optional[_Union[StructuredOutputs, _Mapping]] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., prompt_logprobs: _Optional[int] = ..., cache_salt: _Optional[str] = ..., truncate_prompt_tokens: _Optional[int] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words: _Optional[_Iterable[str]] = ..., priority: _Optional[int] = ...) -> None: ...

class StructuredOutputs(_message.Message):
    __slots__ = ("json", "regex", "choice", "grammar", "json_object")
    JSON_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    json: str
    regex: str
    choice: _containers.RepeatedScalarFieldContainer[str]
    grammar: str
    json_object: bool
    def __init__(self, json: _Optional[str] = ..., regex: _Optional[str] = ..., choice: _Optional[_Iterable[str]] = ..., grammar: _Optional[str] = ..., json_object: _Optional[bool] = ...) -> None: ...

class KvTransferParams(_message.Message):
    __slots__ = ("do_remote_decode", "do_remote_prefill", "connector", "transfer_id", "producer_id", "producer_rank", "producer_tp_size", "engine_epoch", "block_ids", "store_keys", "block_hashes", "num_tokens", "block_size", "remote_host", "remote_port", "handshake_endpoint", "producer_public_key", "lease_id", "lease_expiry_time", "transfer_token", "request_id", "extra")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    DO_REMOTE_DECODE_FIELD_NUMBER: _ClassVar[int]
    DO_REMOTE_PREFILL_FIELD_NUMBER: _ClassVar[int]
    CONNECTOR_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_RANK_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    STORE_KEYS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    REMOTE_HOST_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PORT_FIELD_NUMBER: _ClassVar[int]
    HANDSHAKE_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRY_TIME_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    do_remote_decode: bool
    do_remote_prefill: bool
    connector: str
    transfer_id: str
    producer_id: str
    producer_rank: int
    producer_tp_size: int
    engine_epoch: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    store_keys: _containers.RepeatedScalarFieldContainer[str]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    num_tokens: int
    block_size: int
    remote_host: str
    remote_port: int
    handshake_endpoint: str
    producer_public_key: bytes
    lease_id: str
    lease_expiry_time: float
    transfer_token: bytes
    request_id: str
    extra: _containers.ScalarMap[str, str]
    def __init__(self, do_remote_decode: _Optional[bool] = ..., do_remote_prefill: _Optional[bool] = ..., connector: _Optional[str] = ..., transfer_id: _Optional[str] = ..., producer_id: _Optional[str] = ..., producer_rank: _Optional[int] = ..., producer_tp_size: _Optional[int] = ..., engine_epoch: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., store_keys: _Optional[_Iterable[str]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., num_tokens: _Optional[int] = ..., block_size: _Optional[int] = ..., remote_host: _Optional[str] = ..., remote_port: _Optional[int] = ..., handshake_endpoint: _Optional[str] = ..., producer_public_key: _Optional[bytes] = ..., lease_id: _Optional[str] = ..., lease_expiry_time: _Optional[float] = ..., transfer_token: _Optional[bytes] = ..., request_id: _Optional[str] = ..., extra: _Optional[_Mapping[str, str]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "rank", "decoded")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    DECODED_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    decoded: str
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., decoded: _Optional[str] = ...) -> None: ...

class SampleLogprobs(_message.Message):
    __slots__ = ("sampled", "top")
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    sampled: TokenLogprob
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, sampled: _Optional[_Union[TokenLogprob, _Mapping]] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted_request_ids",)
    ABORTED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    aborted_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, aborted_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("worker_id", "role", "model", "num_running", "num_waiting", "num_waiting_for_remote_kv", "num_preempted", "num_kv_blocks_total", "num_kv_blocks_used", "num_kv_blocks_free", "kv_usage", "prefix_cache_hit_rate", "block_size", "kv_events_endpoint", "kv_snapshot_endpoint", "kv_events_public_key", "kv_events_epoch", "kv_events_seq", "timestamp")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FOR_REMOTE_KV_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    KV_SNAPSHOT_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_EPOCH_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_SEQ_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: WorkerRole
    model: str
    num_running: int
    num_waiting: int
    num_waiting_for_remote_kv: int
    num_preempted: int
    num_kv_blocks_total: int
    num_kv_blocks_used: int
    num_kv_blocks_free: int
    kv_usage: float
    prefix_cache_hit_rate: float
    block_size: int
    kv_events_endpoint: str
    kv_snapshot_endpoint: str
    kv_events_public_key: bytes
    kv_events_epoch: int
    kv_events_seq: int
    timestamp: float
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[WorkerRole, str]] = ..., model: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_waiting_for_remote_kv: _Optional[int] = ..., num_preempted: _Optional[int] = ..., num_kv_blocks_total: _Optional[int] = ..., num_kv_blocks_used: _Optional[int] = ..., num_kv_blocks_free: _Optional[int] = ..., kv_usage: _Optional[float] = ..., prefix_cache_hit_rate: _Optional[float] = ..., block_size: _Optional[int] = ..., kv_events_endpoint: _Optional[str] = ..., kv_snapshot_endpoint: _Optional[str] = ..., kv_events_public_key: _Optional[bytes] = ..., kv_events_epoch: _Optional[int] = ..., kv_events_seq: _Optional[int] = ..., timestamp: _Optional[float] = ...) -> None: ...

class EcItemRef(_message.Message):
    __slots__ = ("mm_hash", "lease_id", "nbytes", "num_tokens")
    MM_HASH_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    mm_hash: str
    lease_id: str
    nbytes: int
    num_tokens: int
    def __init__(self, mm_hash: _Optional[str] = ..., lease_id: _Optional[str] = ..., nbytes: _Optional[int] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class EcTransferParams(_message.Message):
    __slots__ = ("connector", "producer_id", "address", "public_key", "fingerprint", "engine_epoch", "expires_at", "items")
    CONNECTOR_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    connector: str
    producer_id: str
    address: str
    public_key: bytes
    fingerprint: str
    engine_epoch: int
    expires_at: float
    items: _containers.RepeatedCompositeFieldContainer[EcItemRef]
    def __init__(self, connector: _Optional[str] = ..., producer_id: _Optional[str] = ..., address: _Optional[str] = ..., public_key: _Optional[bytes] = ..., fingerprint: _Optional[str] = ..., engine_epoch: _Optional[int] = ..., expires_at: _Optional[float] = ..., items: _Optional[_Iterable[_Union[EcItemRef, _Mapping]]] = ...) -> None: ...
