"""Engine configuration: frozen, validated dataclasses.

Users fill `EngineArgs` (mutable, every field may be "auto"); `EngineArgs.create_engine_config()`
resolves every "auto" (dtype from the checkpoint, backends from the device, number of KV blocks
from the memory budget) and returns a frozen `EngineConfig`. Nothing downstream sees "auto".
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from pdcluster.dtypes import ITEMSIZE, SUPPORTED_DTYPES
from pdcluster.models.hf_config import ModelConfig, load_model_config

BACKENDS = ("auto", "torch", "triton")
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30  # 1 GiB
KV_ROLES = ("producer", "consumer", "both")
# What an engine KV cache may be stored in: the compute dtypes, or fp8 e4m3 (quantised on write,
# dequantised on read with per-layer k/v scales; pdcluster/models/layers/kv_quant.py).
KV_CACHE_DTYPES: tuple[str, ...] = (*SUPPORTED_DTYPES, "float8_e4m3fn")
# vLLM's spellings of the fp8 cache ("fp8" is e4m3, as in vLLM on CUDA).
KV_CACHE_DTYPE_ALIASES = MappingProxyType({"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"})


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    num_blocks: int
    kv_cache_memory_bytes: int
    kv_cache_dtype: str  # resolved dtype name
    enable_prefix_caching: bool


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    # vLLM's --scheduling-policy: "fcfs", or "priority" (SamplingParams.priority, lower first:
    # the waiting queue and the running batch in (priority, arrival) order, the last preempted).
    policy: str = "fcfs"
    # Ours (--kv-load-wait-ms): when requests at the head of the queue have KV to load (a decode
    # worker's hand-offs) while others run, a step starts those loads alone and the engine holds
    # the running requests' next step up to this long for them to land, so the loaded requests
    # join that step instead of the one after it (engine_core.EngineCore._await_loads). 0: the
    # load overlaps a step of the running requests (vLLM's way).
    kv_load_wait_s: float = 0.0
    # vLLM's --long-prefill-token-threshold: a prompt chunk computes at most this many tokens per
    # step (0: up to the budget). On a decode worker that also prefills (conditional or load-aware
    # disaggregation) it bounds how long one step stalls the running decodes: their inter-token gap
    # grows by a chunk's time, not a whole prompt's.
    long_prefill_token_threshold: int = 0


SCHEDULING_POLICIES = ("fcfs", "priority")
# An upper bound against typos: a hold past a step or two of the running requests never pays.
MAX_KV_LOAD_WAIT_MS = 60_000
SPECULATIVE_METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's --speculative-config for draft-free speculation (engine/ngram_proposer.py).

    method "ngram" (prompt lookup): each decode step of a request proposes the
    num_speculative_tokens tokens that followed the latest earlier occurrence of its last n tokens
    (n from prompt_lookup_max down to prompt_lookup_min, over prompt and output); one forward
    checks them all, and the tokens the model would have produced anyway are kept.
    disable_by_batch_size: no drafts while this many requests or more run (a large batch is
    bound by its arithmetic, where extra rows to check cost what they save).
    adaptive (ours, not vLLM's): check a draft only where the measured cost of a row and the
    request's share of drafts kept say it pays (engine/draft_policy.py); false checks every draft
    found, as vLLM does."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    disable_by_batch_size: int | None = None
    adaptive: bool = True

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig | None:
        """None / "" / {} -> None; a dict or its JSON text -> a checked config. ValueError names the
        key and its limit."""
        if value is None or value == "" or value == {}:
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config must be a JSON object: {e}") from None
        if isinstance(value, SpeculativeConfig):
            value = dataclasses.asdict(value)
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}")
        method = value.get("method", cls.method)
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method must be one of {SPECULATIVE_METHODS} (draft models "
                             f"and EAGLE are not served), got {method!r}")
        n = value.get("num_speculative_tokens", cls.num_speculative_tokens)
        lo = value.get("prompt_lookup_min", None)
        hi = value.get("prompt_lookup_max", None)
        # vLLM: one of the two given sets the other.
        lo, hi = (lo if lo is not None else (hi if hi is not None else cls.prompt_lookup_min),
                  hi if hi is not None else (lo if lo is not None else cls.prompt_lookup_max))
        for name, v, top in (("num_speculative_tokens", n, MAX_SPECULATIVE_TOKENS), ("prompt_lookup_min", lo, 64),
                             ("prompt_lookup_max", hi, 64)):
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= top:
                raise ValueError(f"speculative_config.{name} must be an integer in [1, {top}], got {v!r}")
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
        off = value.get("disable_by_batch_size")
        if off is not None and (isinstance(off, bool) or not isinstance(off, int) or off < 2):
            raise ValueError(f"speculative_config.disable_by_batch_size must be an integer >= 2 or null, got {off!r}")
        adaptive = value.get("adaptive", True)
        if not isinstance(adaptive, bool):
            raise ValueError(f"speculative_config.adaptive must be true or false, got {adaptive!r}")
        return cls(method, n, hi, lo, off, adaptive)


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    # A model collective (all-reduce / all-gather) that waits longer than this fails the step and
    # takes the TP instance down: a rank that stops answering must not hang the engine.
    collective_timeout_s: float = 120.0


@dataclass(frozen=True)
class MultiModalConfig:
    """Limits on a request's images (ValueError naming the limit) and the encoder cache budget."""

    max_images_per_request: int = 8
    max_image_bytes: int = 20 << 20  # an encoded image (bytes, data URL)
    max_image_pixels: int = 4096 * 4096  # width * height, checked before decoding the pixels
    encoder_cache_bytes: int = 256 << 20  # engine-local LRU of encoder outputs (0: no cache)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: str  # "cpu" | "cuda"
    attention_backend: str  # "torch" | "triton"
    ops_backend: str  # "torch" | "triton"
    seed: int
    tokenizer_path: str
    # KV connector (DESIGN.md section 5): a name the connector registry resolves (built-in, entry
    # point or "pkg.mod:Class"), its options (plain data), and which legs this engine serves.
    # The engine never imports connectors/: the service hands it a factory built from these.
    kv_connector: str | None = None
    kv_connector_options: dict[str, Any] = field(default_factory=dict)
    kv_role: str = "both"
    mm: MultiModalConfig = field(default_factory=MultiModalConfig)
    # EC connector (engine/ec_connector.py): a name connectors/registry.py's EC_CONNECTORS resolves
    # and its options; encoder_only: run only the vision tower + projector (no decoder, no KV).
    ec_connector: str = ""
    ec_connector_options: dict[str, Any] = field(default_factory=dict)
    encoder_only: bool = False
    # True: never torch.compile the forward (engine/compiled_forward.py says where it compiles).
    enforce_eager: bool = False
    # Speculative decoding (the scheduler proposes, the runner verifies); None: off.
    speculative: SpeculativeConfig | None = None


@dataclass
class EngineArgs:
    """User-facing engine options (the keyword arguments of `LLM(...)`)."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    # "auto": `dtype`, except on CPUs without native bfloat16/float16 arithmetic (no AVX512-BF16 or
    # AMX), where half-precision GEMMs run 3-4x slower than float32: weights are widened to float32
    # at load. Pass the dtype itself to force it.
    compute_dtype: str = "auto"
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"  # vLLM's flag: "fcfs" | "priority" (SchedulerConfig.policy)
    kv_load_wait_ms: float = 0.0  # SchedulerConfig.kv_load_wait_s, in ms (0: off)
    long_prefill_token_threshold: int = 0  # SchedulerConfig's (0: off)
    kv_cache_memory_bytes: int | None = None
    num_kv_blocks: int | None = None  # overrides the memory budget (tests force tiny caches)
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    tp_collective_timeout_s: float = 120.0  # see ParallelConfig.collective_timeout_s
    device: str = "auto"
    attention_backend: str = "auto"
    ops_backend: str = "auto"
    seed: int = 0
    # vLLM's flag: a MoE model's experts partitioned across the TP ranks instead of each split.
    enable_expert_parallel: bool = False
    # vLLM's flag: run the forward eagerly instead of under torch.compile (compiled_forward.py).
    enforce_eager: bool = False
    # vLLM's flag: a dict or its JSON text, e.g. {"method": "ngram", "num_speculative_tokens": 4}.
    speculative_config: dict[str, Any] | str | None = None
    kv_connector: str | None = None
    kv_connector_options: dict[str, Any] | None = None
    kv_role: str = "both"  # "producer" | "consumer" | "both"
    # Multimodal checkpoints (LLaVA): see MultiModalConfig.
    max_images_per_request: int = MultiModalConfig.max_images_per_request
    max_image_bytes: int = MultiModalConfig.max_image_bytes
    max_image_pixels: int = MultiModalConfig.max_image_pixels
    encoder_cache_bytes: int = MultiModalConfig.encoder_cache_bytes
    # Encoder-cache sharing (engine/ec_connector.py): "" = none, built-in "p2p_ec".
    ec_connector: str = ""
    ec_connector_options: dict[str, Any] | None = None
    encoder_only: bool = False  # load and run only the vision tower + projector (an encode instance)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        unknown = sorted(set(kwargs) - cls.field_names())
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; known options: {sorted(cls.field_names())}")
        return cls(**kwargs)

    def create_engine_config(self) -> EngineConfig:
        from pdcluster.models.registry import resolve_model_path

        model_path = resolve_model_path(self.model)
        device = _resolve_device(self.device)
        model_cfg = load_model_config(model_path, dtype=self.dtype, max_model_len=self.max_model_len)
        model_cfg = _apply_compute_dtype(model_cfg, self.compute_dtype, device)
        model_cfg = _apply_expert_parallel(model_cfg, self.enable_expert_parallel, self.tensor_parallel_size)
        if not (isinstance(self.block_size, int) and 1 <= self.block_size <= 1024):
            raise ValueError(f"block_size must be an integer in [1, 1024], got {self.block_size!r}")
        if not (isinstance(self.max_num_seqs, int) and 1 <= self.max_num_seqs <= 4096):
            raise ValueError(f"max_num_seqs must be in [1, 4096], got {self.max_num_seqs!r}")
        tp = self.tensor_parallel_size
        if not (isinstance(tp, int) and tp >= 1):
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
        tp_timeout = self.tp_collective_timeout_s
        if isinstance(tp_timeout, bool) or not isinstance(tp_timeout, (int, float)) or not tp_timeout > 0:
            raise ValueError(f"tp_collective_timeout_s must be a positive number, got {tp_timeout!r}")
        max_len = model_cfg.max_model_len
        mnbt = self.max_num_batched_tokens
        if mnbt is None:
            mnbt = max(2048, self.max_num_seqs) if self.enable_chunked_prefill else max(max_len, self.max_num_seqs)
        if not isinstance(mnbt, int) or mnbt < 1:
            raise ValueError(f"max_num_batched_tokens must be a positive integer, got {mnbt!r}")
        if not self.enable_chunked_prefill and mnbt < max_len:
            raise ValueError(
                f"max_num_batched_tokens ({mnbt}) must be >= max_model_len ({max_len}) without chunked prefill")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        load_wait = self.kv_load_wait_ms
        if (isinstance(load_wait, bool) or not isinstance(load_wait, (int, float))
                or not 0 <= load_wait <= MAX_KV_LOAD_WAIT_MS):
            raise ValueError(f"kv_load_wait_ms must be a number of milliseconds in [0, {MAX_KV_LOAD_WAIT_MS}], "
                             f"got {load_wait!r}")
        long_prefill = self.long_prefill_token_threshold
        if isinstance(long_prefill, bool) or not isinstance(long_prefill, int) or long_prefill < 0:
            raise ValueError(f"long_prefill_token_threshold must be an integer >= 0 (0: off), got {long_prefill!r}")
        if long_prefill and not self.enable_chunked_prefill:
            raise ValueError(f"long_prefill_token_threshold={long_prefill} caps prompt chunks: it needs "
                             "enable_chunked_prefill")
        kv_dtype = resolve_kv_cache_dtype(self.kv_cache_dtype, model_cfg.dtype)
        speculative = SpeculativeConfig.parse(self.speculative_config)
        _check_tp_shapes(model_cfg, tp)
        if model_cfg.architecture == "LlavaForConditionalGeneration" and tp > 1:
            raise ValueError(f"tensor_parallel_size={tp}: LlavaForConditionalGeneration runs with "
                             "tensor_parallel_size=1 only (the vision tower is not sharded yet)")
        mm_cfg = _check_mm(self)
        cache_cfg = _resolve_cache(self, model_cfg, kv_dtype, device, tp)
        if self.encoder_only is True:  # no KV cache is allocated: the scheduler's pool stays tiny
            cache_cfg = dataclasses.replace(cache_cfg, num_blocks=-(-max_len // self.block_size),
                                            kv_cache_memory_bytes=0)
        for name in ("attention_backend", "ops_backend"):
            if getattr(self, name) not in BACKENDS:
                raise ValueError(f"{name} must be one of {BACKENDS}, got {getattr(self, name)!r}")
        # "auto": Triton on CUDA, the torch reference kernels on CPU.
        auto_backend = "triton" if device == "cuda" else "torch"
        kv_connector, kv_options = _check_kv_connector(self)
        ec_connector, ec_options = _check_ec(self, model_cfg)
        return EngineConfig(
            model=model_cfg,
            cache=cache_cfg,
            scheduler=SchedulerConfig(self.max_num_seqs, mnbt, max_len, self.enable_chunked_prefill,
                                      self.scheduling_policy, load_wait / 1000.0, long_prefill),
            parallel=ParallelConfig(tp, float(tp_timeout)),
            device=device,
            attention_backend=auto_backend if self.attention_backend == "auto" else self.attention_backend,
            ops_backend=auto_backend if self.ops_backend == "auto" else self.ops_backend,
            seed=self.seed,
            tokenizer_path=self.tokenizer or model_path,
            kv_connector=kv_connector,
            kv_connector_options=kv_options,
            kv_role=self.kv_role,
            mm=mm_cfg,
            ec_connector=ec_connector,
            ec_connector_options=ec_options,
            encoder_only=bool(self.encoder_only),
            enforce_eager=bool(self.enforce_eager),
            speculative=speculative,
        )


def _check_mm(args: EngineArgs) -> MultiModalConfig:
    for name in ("max_images_per_request", "max_image_bytes", "max_image_pixels"):
        v = getattr(args, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    v = args.encoder_cache_bytes
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"encoder_cache_bytes must be an integer >= 0, got {v!r}")
    return MultiModalConfig(args.max_images_per_request, args.max_image_bytes, args.max_image_pixels, v)


def _check_kv_connector(args: EngineArgs) -> tuple[str | None, dict[str, Any]]:
    if args.kv_role not in KV_ROLES:
        raise ValueError(f"kv_role must be one of {KV_ROLES}, got {args.kv_role!r}")
    name = args.kv_connector or None
    if name is not None and not isinstance(name, str):
        raise ValueError(f"kv_connector must be a connector name or 'pkg.module:Class', got {name!r}")
    options = args.kv_connector_options or {}
    if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
        raise ValueError("kv_connector_options must be a dict with string keys")
    if options and name is None:
        raise ValueError("kv_connector_options given without kv_connector")
    return name, dict(options)


def _check_ec(args: EngineArgs, model: ModelConfig) -> tuple[str, dict[str, Any]]:
    name = args.ec_connector or ""
    if not isinstance(name, str):
        raise ValueError(f"ec_connector must be a connector name or 'pkg.module:Class', got {name!r}")
    options = args.ec_connector_options or {}
    if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
        raise ValueError("ec_connector_options must be a dict with string keys")
    if options and not name:
        raise ValueError("ec_connector_options given without ec_connector")
    if not isinstance(args.encoder_only, bool):
        raise ValueError(f"encoder_only must be true or false, got {args.encoder_only!r}")
    if (name or args.encoder_only) and model.architecture != "LlavaForConditionalGeneration":
        what = "encoder_only" if args.encoder_only else f"ec_connector={name!r}"
        raise ValueError(f"{what}: model {model.architecture} has no vision encoder")
    return name, dict(options)


def _apply_expert_parallel(model: ModelConfig, enable: Any, tp: Any) -> ModelConfig:
    """vLLM's --enable-expert-parallel: a MoE model's experts are partitioned across the TP ranks
    (models/layers/fused_moe.py). A dense model or tensor_parallel_size 1 has nothing to partition."""
    if not isinstance(enable, bool):
        raise ValueError(f"enable_expert_parallel must be true or false, got {enable!r}")
    if not enable or not model.num_experts or not isinstance(tp, int) or tp < 2:
        return model
    if model.num_experts < tp:
        raise ValueError(f"enable_expert_parallel: {model.num_experts} experts cannot be partitioned over "
                         f"tensor_parallel_size={tp} ranks (at least one expert per rank)")
    return dataclasses.replace(model, expert_parallel=True)


def _check_tp_shapes(model: ModelConfig, tp: int) -> None:
    """Every sharded dimension must split evenly over the ranks (checked before any rank starts)."""
    if tp == 1:
        return
    kv = model.num_key_value_heads
    checks = [("num_attention_heads", model.num_attention_heads, model.num_attention_heads % tp == 0),
              ("intermediate_size", model.intermediate_size, model.intermediate_size % tp == 0),
              ("num_key_value_heads", kv, kv % tp == 0 if kv >= tp else tp % kv == 0)]
    for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):  # MoE experts split like the MLP
        if name == "moe_intermediate_size" and model.expert_parallel:
            continue  # whole experts per rank
        size = getattr(model, name)
        checks.append((name, size, size % tp == 0))
    bad = [f"{name}={value}" for name, value, ok in checks if not ok]
    if bad:
        rule = (" (KV heads must be a multiple of the TP size, or divide it when there are fewer: those are "
                "replicated)" if any(b.startswith("num_key_value_heads") for b in bad) else "")
        raise ValueError(f"tensor_parallel_size={tp} does not divide the model: {', '.join(bad)} must each be a "
                         f"multiple of {tp}{rule}")


def resolve_kv_cache_dtype(name: Any, model_dtype: str) -> str:
    """"auto" -> the model dtype; "fp8"/"fp8_e4m3" -> "float8_e4m3fn"; ValueError otherwise."""
    kv_dtype = model_dtype if name == "auto" else KV_CACHE_DTYPE_ALIASES.get(name, name)
    if kv_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be 'auto', one of {sorted(KV_CACHE_DTYPE_ALIASES)} or one of "
                         f"{KV_CACHE_DTYPES}, got {name!r}")
    return kv_dtype


def kv_bytes_per_block(model: ModelConfig, block_size: int, kv_dtype: str, tp: int = 1) -> int:
    """Bytes of one KV block on one TP rank (K and V, every layer). KV heads are split across
    ranks, or replicated when there are fewer KV heads than ranks."""
    if kv_dtype not in KV_CACHE_DTYPES:
        raise KeyError(kv_dtype)
    itemsize = ITEMSIZE[kv_dtype]
    local_kv_heads = max(1, model.num_key_value_heads // tp)
    return 2 * model.num_hidden_layers * block_size * local_kv_heads * model.head_dim * itemsize


def _apply_compute_dtype(model: ModelConfig, compute_dtype: str, device: str) -> ModelConfig:
    if compute_dtype == "auto":
        slow_half = device == "cpu" and model.dtype != "float32" and not cpu_has_fast_half_precision()
        compute_dtype = "float32" if slow_half else model.dtype
    if compute_dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"compute_dtype must be 'auto' or one of {SUPPORTED_DTYPES}, got {compute_dtype!r}")
    if compute_dtype == model.dtype:
        return model
    return dataclasses.replace(model, dtype=compute_dtype, requested_dtype=model.dtype)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (/proc/cpuinfo's x86 `flags` or Arm `Features`; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_fast_half_precision() -> bool:
    """True when this CPU has native bf16 dot products (x86 AVX512-BF16 / AMX, Arm BF16)."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16", "bf16"})


def _resolve_device(device: str) -> str:
    if device == "auto":
        if os.environ.get("PDCLUSTER_DEVICE"):
            return os.environ["PDCLUSTER_DEVICE"]
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    return device


def _resolve_cache(args: EngineArgs, model: ModelConfig, kv_dtype: str, device: str, tp: int) -> CacheConfig:
    per_block = kv_bytes_per_block(model, args.block_size, kv_dtype, tp)
    if args.num_kv_blocks is not None:
        if not isinstance(args.num_kv_blocks, int) or args.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be a positive integer, got {args.num_kv_blocks!r}")
        num_blocks = args.num_kv_blocks
        budget = num_blocks * per_block
    else:
        budget = args.kv_cache_memory_bytes
        if budget is None:
            budget = DEFAULT_CPU_KV_CACHE_BYTES if device == "cpu" else _cuda_kv_budget()
        if not isinstance(budget, int) or budget < per_block:
            raise ValueError(
                f"kv_cache_memory_bytes must hold at least one block ({per_block} bytes), got {budget!r}")
        num_blocks = budget // per_block
    blocks_per_seq = -(-model.max_model_len // args.block_size)
    if model.kv_window is not None and not args.kv_connector:
        # Every layer slides and blocks behind the window are freed (the scheduler, without a
        # connector): one sequence of any length needs only its window's blocks (kv_window.py).
        from pdcluster.engine.kv_window import min_pool_blocks

        blocks_per_seq = min(blocks_per_seq, min_pool_blocks(model.kv_window, args.block_size))
    if num_blocks < blocks_per_seq:
        raise ValueError(
            f"KV cache of {num_blocks} blocks cannot hold one sequence of max_model_len={model.max_model_len} "
            f"({blocks_per_seq} blocks of {args.block_size} tokens); raise kv_cache_memory_bytes or lower "
            f"max_model_len")
    return CacheConfig(args.block_size, num_blocks, budget, kv_dtype, args.enable_prefix_caching)


def _cuda_kv_budget() -> int:
    import torch

    free, _total = torch.cuda.mem_get_info()
    return int(free * 0.5)


def engine_args_from_dict(d: dict[str, Any]) -> EngineArgs:
    return EngineArgs.from_kwargs(**d)


__all__ = [
    "CacheConfig", "EngineArgs", "EngineConfig", "MultiModalConfig", "ParallelConfig", "SchedulerConfig", "SpeculativeConfig", "kv_bytes_per_block",
    "resolve_kv_cache_dtype",
]
