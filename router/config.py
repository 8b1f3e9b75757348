"""RouterConfig: every knob of one router, frozen and validated at construction."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pdcluster.sampling_params import DEFAULT_MAX_STOP_TOKEN_IDS, MAX_STOP_TOKEN_IDS
from pdcluster.worker.tls import TLSConfig

from .policies import ROUTING_POLICIES
from .reasoning import get_parser
from .response_store import DEFAULT_RESPONSES_STORE_BYTES

DEFAULT_MAX_MESSAGE_BYTES = 4 << 20  # gRPC's own default; prompts of ~1M tokens still fit
WORKER_CHANNELS = ("stream", "call")
DISAGG_MODES = ("sequential", "concurrent")

DEFAULT_MAX_JSON_DEPTH = 32


@dataclass(frozen=True)
class RouterConfig:
    workers: tuple[str, ...] = ()            # static worker list, "host:port"
    model: str | None = None                 # model dir (tokenizer); None = ask the first worker
    # The names clients pass (vLLM's --served-model-name takes several; all are listed); a string is
    # one name; None = `model` as given (its basename accepted too, not listed).
    served_model_name: str | tuple[str, ...] | None = None
    # Jinja chat template text (vLLM's --chat-template, read by tokenizer.load_chat_template): used
    # instead of the model's own, e.g. for a checkpoint that has none. None = the model's.
    chat_template: str | None = None
    # vLLM's --reasoning-parser (router/reasoning.py): chat answers carry the model's thought in
    # message.reasoning, apart from the content. None = the text as generated.
    reasoning_parser: str | None = None
    # vLLM's --tool-call-parser (router/tool_parsers.py): how tool_choice "auto" reads calls out
    # of an answer (hermes, llama3_json, mistral, pythonic, or a plugin's "module:function").
    tool_call_parser: str = "hermes"
    # vLLM's --generation-config (pdcluster/generation_defaults.py): "auto" (the model's
    # generation_config.json sampling defaults), "vllm" (none) or a folder holding the file.
    generation_config: str = "auto"
    policy: str = "prefix_aware"             # falls back to least_loaded without KV events
    host: str = "127.0.0.1"                  # loopback by default; other addresses are explicit
    grpc_port: int = 50051                   # 0 = any free port
    http_port: int | None = 8000             # None = no HTTP frontend
    max_inflight: int = 1024                 # admission control: more -> RESOURCE_EXHAUSTED
    max_retries: int = 2                     # extra attempts on other workers, before the first token
    # After the first token: resume a request whose worker failed on another worker, from the
    # prompt plus the tokens already streamed (router/migration.py); 0 = end it with an error.
    max_migrations: int = 2
    # After the first token, a leg that sends nothing for this long is treated as a failed worker
    # (SIGSTOPped, hung) and migrated; 0 = wait for the request's deadline.
    stall_timeout_s: float = 0.0
    health_interval_s: float = 1.0           # health check + Stats poll period per worker
    health_timeout_s: float = 2.0
    eject_after_failures: int = 3            # consecutive failed checks before ejection
    request_timeout_s: float = 600.0         # deadline of requests that bring none (HTTP, gRPC w/o)
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # gRPC messages and HTTP bodies
    key_dir: str | None = None               # CURVE keys: subscribe to workers' KV events
    key_name: str = "router"                 # this router's key pair in key_dir
    kv_poll_interval_s: float = 0.01         # how often KV events are applied to the index
    prefix_load_weight: float = 0.5
    # Disaggregation (router/disagg_rule.py): a decode worker prefills a prompt itself when its
    # uncached part is at most disagg_min_uncached_tokens, or when the least busy prefill worker
    # has more than disagg_max_prefill_backlog_tokens prompt tokens queued and a decode worker
    # would be done with the prompt before the prefill worker could start it (0: neither rule).
    disagg_min_uncached_tokens: int = 0
    disagg_max_prefill_backlog_tokens: int = 0
    # ... and only while a decode worker has at most this many requests in flight (None: any).
    disagg_max_decode_inflight: int | None = None
    # "sequential": the decode leg is sent when the prefill leg has returned; "concurrent": both
    # legs at once, the decode worker admits its leg while prefill runs and gets the params by
    # Worker.ProvideKVParams (router/concurrent_disagg.py). A decode leg waits for them at most
    # disagg_params_timeout_s.
    disagg_mode: str = "sequential"
    disagg_params_timeout_s: float = 60.0
    worker_wait_timeout_s: float = 60.0      # startup: wait this long for a worker (model/tokenizer)
    tls: TLSConfig | None = None             # frontends (gRPC and HTTPS); ca= requires client certs
    worker_tls: TLSConfig | None = None      # channels to the workers (ca= verifies them)
    # "stream": all requests to a worker over one Worker.GenerateStream (batched deltas);
    # "call": one Worker.Generate call per request (workers without GenerateStream, comparisons).
    worker_channel: str = "stream"
    # Bounds on request data (issue 16): each refusal names the field and the limit.
    max_stop_token_ids: int = DEFAULT_MAX_STOP_TOKEN_IDS
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH  # HTTP bodies / JSON fields nested deeper -> 400
    params_cache_bytes: int = 4 << 20        # memo of validated sampling params, bounded by bytes
    # Stored Responses (router/response_store.py: store, previous_response_id); 0 = none kept.
    responses_store_bytes: int = DEFAULT_RESPONSES_STORE_BYTES
    # Multimodal models: image_url parts per request and bytes per (decoded) image.
    max_images_per_request: int = 8
    max_image_bytes: int = 20 << 20
    # Encoder-cache sharing (router/ec_stage.py): the longest an Encode call may take before the
    # request goes on without it (the prefill worker encodes locally), and how many images the
    # router remembers an encoder or a holder for (LRU).
    encode_timeout_s: float = 30.0
    ec_directory_images: int = 4096
    # Per HTTP/2 connection (one peer's channel) and in all; None = derived from max_inflight.
    max_concurrent_streams: int | None = None
    max_concurrent_rpcs: int | None = None
    # HTTP frontend, per client address (router/peer_limits.py); None = max_inflight + 64 each,
    # above the global cap, so by default the global admission answers first (set them lower
    # to keep one client from taking every place).
    max_http_connections_per_peer: int | None = None
    max_http_requests_per_peer: int | None = None
    # Client authentication (vLLM's --api-key): `Authorization: Bearer <key>` on HTTP and gRPC.
    api_key: str | tuple[str, ...] | None = field(default=None, repr=False)  # one key or several (a tuple after init)
    # Allow a non-loopback host with neither TLS nor an API key (refused otherwise).
    insecure: bool = False
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("served_model_name", "api_key"):  # one string or several: a tuple from here on
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _strings(name, value))
        if self.reasoning_parser is not None:
            get_parser(self.reasoning_parser)
        from .tool_parsers import TOOL_CALL_PARSERS

        try:
            TOOL_CALL_PARSERS.get(self.tool_call_parser)
        except ValueError as e:
            raise ValueError(f"tool_call_parser: {e}") from None
        if self.policy not in ROUTING_POLICIES:
            raise ValueError(f"policy: unknown routing policy {self.policy!r}; choose one of {ROUTING_POLICIES.names()}")
        for name in ("max_inflight", "eject_after_failures", "max_message_bytes", "max_json_depth",
                     "params_cache_bytes", "max_images_per_request", "max_image_bytes", "ec_directory_images"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.responses_store_bytes < 0:
            raise ValueError(f"responses_store_bytes must be >= 0 (0: none kept), got {self.responses_store_bytes}")
        for name in ("disagg_min_uncached_tokens", "disagg_max_prefill_backlog_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.disagg_max_decode_inflight is not None:
            if self.disagg_max_decode_inflight < 0:
                raise ValueError(f"disagg_max_decode_inflight must be >= 0, got {self.disagg_max_decode_inflight}")
            if self.disagg_max_prefill_backlog_tokens == 0:
                raise ValueError("disagg_max_decode_inflight limits load-aware disaggregation: it needs "
                                 "disagg_max_prefill_backlog_tokens > 0")
        if self.disagg_mode not in DISAGG_MODES:
            raise ValueError(f"disagg_mode: {self.disagg_mode!r} is not one of {DISAGG_MODES}")
        if not 0 < self.disagg_params_timeout_s <= 3600:
            raise ValueError(f"disagg_params_timeout_s must be in (0, 3600], got {self.disagg_params_timeout_s}")
        if self.worker_channel not in WORKER_CHANNELS:
            raise ValueError(f"worker_channel: {self.worker_channel!r} is not one of {WORKER_CHANNELS}")
        if not 0 <= self.max_stop_token_ids <= MAX_STOP_TOKEN_IDS:
            raise ValueError(f"max_stop_token_ids must be in [0, {MAX_STOP_TOKEN_IDS}], got {self.max_stop_token_ids}")
        for name in ("max_concurrent_streams", "max_concurrent_rpcs", "max_http_connections_per_peer",
                     "max_http_requests_per_peer"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("max_retries", "max_migrations", "stall_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("health_interval_s", "health_timeout_s", "request_timeout_s", "kv_poll_interval_s",
                     "worker_wait_timeout_s", "encode_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("grpc_port", "http_port"):
            port = getattr(self, name)
            if port is not None and not 0 <= port <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {port}")
        for w in self.workers:
            _check_address(w)
        object.__setattr__(self, "workers", tuple(self.workers))

    def replace(self, **changes: object) -> RouterConfig:
        return dataclasses.replace(self, **changes)

    @property
    def streams_per_connection(self) -> int:
        return self.max_concurrent_streams or self.max_inflight + 64  # headroom: health, Abort

    @property
    def http_connections_per_peer(self) -> int:
        return self.max_http_connections_per_peer or self.max_inflight + 64

    @property
    def http_requests_per_peer(self) -> int:
        return self.max_http_requests_per_peer or self.max_inflight + 64

    @property
    def concurrent_rpcs(self) -> int:
        return self.max_concurrent_rpcs or 2 * self.max_inflight + 64


def _check_address(address: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"workers: {address!r} is not host:port")


def parse_worker_list(text: str) -> tuple[str, ...]:
    """'h1:p1,h2:p2' -> ('h1:p1', 'h2:p2'), checked."""
    out = tuple(w.strip() for w in text.split(",") if w.strip())
    for w in out:
        _check_address(w)
    return out


def _strings(name: str, value: str | tuple[str, ...]) -> tuple[str, ...]:
    """One non-empty string, or several, as a tuple (ValueError naming the field otherwise)."""
    values = (value,) if isinstance(value, str) else tuple(value)
    if not values or not all(isinstance(v, str) and v for v in values):
        raise ValueError(f"{name} must not be empty")
    return values
