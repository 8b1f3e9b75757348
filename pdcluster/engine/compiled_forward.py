"""The decoder forward under torch.compile (inductor's CPU backend: C++ through the machine's
compiler), attention left outside the compiled code.

Where: a dense decoder-only model (no MoE, no image tower), tensor_parallel_size 1, torch backends
on CPU, and by default (PDCLUSTER_COMPILE=auto) only a model of at least AUTO_MIN_PARAMS
parameters, where the gain repays the compile time;
PDCLUSTER_COMPILE=1 compiles any supported model, 0 none. `enforce_eager=True` (vLLM's flag,
`--enforce-eager`) always runs eagerly.

Regional compilation: each decoder layer is compiled, not the whole model, so compile time does
not grow with depth (every layer runs the same graph, its parameters as graph inputs); the
embedding, final norm and LM head stay eager. The token count is symbolic: one graph serves every
step, whatever its size, so no per-batch-size buckets (measured on the demo model: a static graph
per bucket cost ~12 s CPU of compile each, 11 buckets for max_num_seqs=64; the one dynamic graph
~25 s cold, ~6 s warm, half of that importing inductor).

Which steps: those with prefill tokens (prefill chunks, mixed prefill + decode) run compiled:
1.07-1.28x faster on the 125M Llama (fusion of the norm/rotary/SiLU elementwise work over many
rows). Decode-only steps run eagerly: measured there, compiled was no faster (B=32: 0.99-1.0x)
or slower (B=8 bf16: 0.93x; batch-1 fp32: 0.66x, a 1-token step padded to 2 doubled the float32
GEMMs, and unpadded it would specialise another graph). Numbers: benchmarks/RESULTS.md (issue 14,
torch.compile). A step with prefill tokens also runs eagerly when the runner's thread tuner picked
a count other than the full one the layers were compiled for (`eager=True`; thread_tuner.step_plan).

Attention stays eager: every layer's `Attention.backend` is wrapped (`_TracedAttention`); eagerly
the wrapper calls the real backend unchanged, but while dynamo traces it emits one opaque custom op,
`pdcluster::paged_attention(q, k, v, scale, window)`. The op reads the step's metadata, KV cache and
backend from a ContextVar set around the layer loop, so neither the metadata (Python lists that
change every step) nor the KV cache (written in place) enter the graph: no guard on them, no
recompile per step, no functionalised copy of the cache. Compiled artefacts go to inductor's FX
graph cache under TORCHINDUCTOR_CACHE_DIR (default $PDCLUSTER_HOME/inductor, ~/.cache/pdcluster).

Start-up (PDCLUSTER_COMPILE_START): `background` (default) returns at once and compiles on a daemon
thread ("pdcluster-compile"); every step runs the eager model until the warm-up succeeded, then the
next step (a flag read at the start of a call, never mid-step) switches to the compiled layers. A
failure logs a warning and the forward stays eager. `wait` compiles before the engine is built (the
benchmarks that measure steady-state speed use it). While any compile session is open in the
process, torch.compiler.is_compiling() is True on EVERY thread (a module global in torch 2.13): so
the eager path here sets CURRENT_LAYER around each layer (a packed linear then takes the
packed_linear op, the same product), the attention wrapper asks is_dynamo_compiling() (per trace),
the warm-up runs on its own attention backend (the backend caches per-step plans), and the LM
head's plain weight is kept until the switch (its packed_now() falls back to F.linear meanwhile).
"""

from __future__ import annotations

import contextvars
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pdcluster.models.layers.attention_backend import AttentionBackend, AttentionMetadata
from pdcluster.models.layers.cpu_gemm import CURRENT_LAYER, name_packed_layers, release_plain_weights

log = logging.getLogger(__name__)

AUTO_MIN_PARAMS = 50_000_000  # PDCLUSTER_COMPILE=auto: smaller models do not repay the compile
START_ENV = "PDCLUSTER_COMPILE_START"  # background (default): serve eagerly meanwhile; wait: compile first
# What the traced layers get for their cache: the op reads the real one from the step.
_NO_KV = (None, None)
# One compile at a time in a process (several engines: tests, benchmarks): side by side they would
# only fight for the same cores. A lock, not state: nothing is stored in it.
_COMPILE_LOCK = threading.Lock()


@dataclass
class _Step:
    backend: AttentionBackend
    meta: AttentionMetadata
    layer_kv_caches: list[torch.Tensor]
    layer: int = 0  # the next attention call's layer: layers run in order, one attention each


# The step the compiled layers are running: set by CompiledForward around the layer loop and read
# by the attention op. A ContextVar, not an attribute: a custom op takes only tensors and scalars,
# and the value is scoped to the call (another thread's engine never sees it).
_CURRENT_STEP: contextvars.ContextVar[_Step] = contextvars.ContextVar("pdcluster_compiled_step")


@torch.library.custom_op("pdcluster::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    """q (T, Hq, D), k/v (T, Hk, D) -> (T, Hq, D): the backend's attention (cache write
    included) for the step's next layer."""
    step = _CURRENT_STEP.get()
    kv = step.layer_kv_caches[step.layer]
    step.layer += 1
    out = step.backend.forward(q.contiguous(), k.contiguous(), v.contiguous(), kv[0], kv[1], step.meta, scale,
                               sliding_window=window or None)
    if out.untyped_storage().data_ptr() == q.untyped_storage().data_ptr():
        return out.clone()  # a custom op's output may not alias its input
    return out.contiguous()  # the strides the fake promised the compiler


@paged_attention.register_fake
def _paged_attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                          window: int) -> torch.Tensor:
    return q.new_empty(q.shape)  # contiguous, whatever q's strides


class _TracedAttention(AttentionBackend):
    """Every layer's backend once compiling is on: eager calls pass through; traced calls become
    the op (no per-layer state, so one compiled layer serves every layer)."""

    def __init__(self, inner: AttentionBackend) -> None:
        self.inner = inner
        self.name = inner.name

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: Any, v_cache: Any,
                meta: Any, scale: float, sliding_window: int | None = None) -> torch.Tensor:
        # Not is_compiling(): that is True on every thread while any compile session is open, and
        # an eager call from the engine thread must not take the op (it reads the traced step).
        if torch.compiler.is_dynamo_compiling():
            return torch.ops.pdcluster.paged_attention(q, k, v, scale, sliding_window or 0)
        return self.inner.forward(q, k, v, k_cache, v_cache, meta, scale, sliding_window)


def cache_dir() -> str:
    """Inductor's cache folder: TORCHINDUCTOR_CACHE_DIR if set, else $PDCLUSTER_HOME/inductor
    (~/.cache/pdcluster/inductor). Put in the environment: inductor reads it there."""
    if not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        home = os.environ.get("PDCLUSTER_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "pdcluster")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(home, "inductor")
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def compile_start_policy() -> str:
    """PDCLUSTER_COMPILE_START: "background" (default) or "wait"."""
    value = os.environ.get(START_ENV, "").strip().lower() or "background"
    if value not in ("background", "wait"):
        raise ValueError(f"{START_ENV} must be background or wait, got {value!r}")
    return value


def compile_unsupported(config: Any, model: torch.nn.Module, policy: str = "auto") -> str | None:
    """Why this engine's forward stays eager, or None when it is compiled. policy: the
    PDCLUSTER_COMPILE value ("auto", "1", "0")."""
    if getattr(config, "enforce_eager", False):
        return "enforce_eager"
    if policy not in ("auto", "1", "0"):
        raise ValueError(f"PDCLUSTER_COMPILE must be auto, 1 or 0, got {policy!r}")
    if policy == "0":
        return "PDCLUSTER_COMPILE=0"
    if config.device != "cpu":
        return f"device {config.device} (the CPU backend only)"
    if (config.attention_backend, config.ops_backend) != ("torch", "torch"):
        return "triton backends"
    if config.parallel.tensor_parallel_size > 1:
        return "tensor_parallel_size > 1 (collectives inside the forward)"
    if getattr(model, "is_multimodal", False):
        return "multimodal model"
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not all(hasattr(layer, "self_attn") for layer in layers):
        return "not a DecoderForCausalLM"
    if any(config.model.is_moe(i) for i in range(len(layers))):
        return "MoE layers (data-dependent expert groups)"
    if policy == "auto" and sum(p.numel() for p in model.parameters()) < AUTO_MIN_PARAMS:
        return f"model under {AUTO_MIN_PARAMS:,} parameters (PDCLUSTER_COMPILE=1 compiles it)"
    return None


class CompiledForward:
    """Callable like the model: (input_ids, positions, kv_caches, meta) -> hidden (T, H).

    state: "compiling" (eager steps; the compile thread runs), "ready" (compiled, switched at the
    next call), "compiled", or "failed" (eager for good); "eager" before a compile started."""

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, layer_kv_caches: list[torch.Tensor]
                 ) -> None:
        cache_dir()
        self.model, self.backend, self.layer_kv_caches = model, backend, layer_kv_caches
        decoder = model.model  # type: ignore[union-attr]
        self._inner_backend = decoder.layers[0].self_attn.backend
        traced = _TracedAttention(backend)
        for layer in decoder.layers:
            layer.self_attn.backend = traced
            name_packed_layers(layer)  # its packed linears trace as the packed_linear op
        self._layers: list[Any] = []  # the compiled layers, built by compile()
        self.compiled_steps = 0  # steps (warm-up included) that ran the compiled layers
        self.eager_prefill_steps = 0  # steps with prefill tokens run eagerly on the tuner's word
        self.state = "eager"
        self.compile_seconds: float | None = None  # wall seconds of compile() (warm-up included)
        self.error: str | None = None
        self.compile_done = threading.Event()  # set when the compile finished, either way
        self._use_compiled = False  # read at the start of each call, so a switch is between steps
        self._on_settle: list[Callable[[], None]] = []  # run on the engine thread at the switch / failure

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Any,
                 meta: AttentionMetadata, eager: bool = False) -> torch.Tensor:
        """One step. `eager`: run a step with prefill tokens eagerly anyway (the runner's thread
        tuner picked fewer threads than the layers were compiled for: thread_tuner.step_plan)."""
        if not self._use_compiled and self.state in ("ready", "failed"):
            self._settle()
        if self._use_compiled and not meta.is_decode_only:  # decode eager: it did not pay (docstring)
            if not eager:
                return self.compiled(input_ids, positions, meta)
            self.eager_prefill_steps += 1
        return self.eager(input_ids, positions, kv_caches, meta)

    def eager(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Any,
              meta: AttentionMetadata) -> torch.Tensor:
        """DecoderModel.forward, with the running layer in CURRENT_LAYER: while a compile session
        is open anywhere in the process a packed linear calls the packed_linear op, which reads it."""
        decoder = self.model.model  # type: ignore[union-attr]
        hidden = decoder.embed_tokens(input_ids)
        fast = decoder.decode_step.run(decoder, hidden, positions, kv_caches, meta)  # cpu_decode_step.py
        if fast is not None:
            return fast
        residual = None
        for i, layer in enumerate(decoder.layers):
            current = CURRENT_LAYER.set(layer)
            try:
                hidden, residual = layer(positions, hidden, residual, kv_caches[i], meta)
            finally:
                CURRENT_LAYER.reset(current)
        hidden, _ = decoder.norm(hidden, residual)
        return hidden

    def compiled(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 backend: AttentionBackend | None = None) -> torch.Tensor:
        """The compiled layers over any step of 2 or more tokens."""
        self.compiled_steps += 1
        decoder = self.model.model  # type: ignore[union-attr]
        # A copy: the runner's positions are normal tensors, the warm-up's inference tensors, and
        # dynamo guards on the dispatch keys that tell them apart.
        positions = positions.clone()
        hidden = decoder.embed_tokens(input_ids)
        # The first layer gets a residual too (zeros: hidden + 0 is hidden, bit for bit), so every
        # layer runs the same graph.
        residual = torch.zeros_like(hidden)
        for t in (positions, hidden, residual):
            torch._dynamo.mark_dynamic(t, 0)
        step = _Step(backend or self.backend, meta, self.layer_kv_caches)
        token = _CURRENT_STEP.set(step)
        try:
            for module, layer in zip(decoder.layers, self._layers):
                current = CURRENT_LAYER.set(module)  # whose packed weights the packed_linear op reads
                try:
                    hidden, residual = layer(positions, hidden, residual, _NO_KV, None)
                finally:
                    CURRENT_LAYER.reset(current)
        finally:
            _CURRENT_STEP.reset(token)
        if step.layer != len(self._layers):
            raise RuntimeError(f"compiled forward ran {step.layer} attention calls for {len(self._layers)} layers")
        hidden, _ = decoder.norm(hidden, residual)
        return hidden

    def compile(self) -> None:
        """Compile the layers and warm them up, on the calling thread (raises what the compiler raises)."""
        t0 = time.perf_counter()
        # One process may build engines of several shapes (tests, benchmarks): each adds variants
        # of the same layer code; past the limit dynamo would silently run it eagerly.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        decoder = self.model.model  # type: ignore[union-attr]
        self._layers = [torch.compile(layer, dynamic=None, fullgraph=True) for layer in decoder.layers]
        self.warm_up()
        self.compile_seconds = time.perf_counter() - t0

    def warm_up(self) -> None:
        """Compile now, on a 2-token step that writes nothing (slots -1). Its own attention backend:
        the engine's caches a per-step plan, and eager steps may run meanwhile on another thread."""
        dev = self.layer_kv_caches[0].device
        meta = AttentionMetadata(
            num_reqs=2, num_tokens=2, query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32, device=dev),
            seq_lens=torch.ones(2, dtype=torch.int32, device=dev), context_lens=torch.zeros(2, dtype=torch.int32,
                                                                                              device=dev),
            block_tables=torch.zeros(2, 1, dtype=torch.int32, device=dev),
            slot_mapping=torch.full((2,), -1, dtype=torch.int64, device=dev), max_query_len=1, max_seq_len=1,
            query_lens_cpu=[1, 1], seq_lens_cpu=[1, 1], context_lens_cpu=[0, 0])
        ids = torch.zeros(2, dtype=torch.int64, device=dev)
        backend = type(self.backend)()
        if hasattr(self.backend, "kv_scales"):  # an fp8 cache's scales (read only)
            backend.kv_scales = self.backend.kv_scales  # type: ignore[attr-defined]
        with torch.inference_mode():
            self.compiled(ids, ids.clone(), meta, backend)

    def start_background(self) -> None:
        """Compile on a daemon thread; steps run eagerly until it is done. Nothing ever joins it:
        an engine shut down meanwhile just lets it run out (it holds the model until then)."""
        self.state = "compiling"
        threading.Thread(target=self._compile_thread, name="pdcluster-compile", daemon=True).start()

    def _compile_thread(self) -> None:
        try:
            with _COMPILE_LOCK, torch.inference_mode():
                self.compile()
        except Exception as e:  # noqa: BLE001 - any compiler failure: stay eager, the engine still works
            self.error = f"{type(e).__name__}: {e}"
            log.warning("torch.compile of the forward failed, running eagerly: %s", self.error)
            self.state = "failed"
        else:
            self.state = "ready"
        finally:
            self.compile_done.set()

    def _settle(self) -> None:
        """On the engine thread, between steps, once the compile thread finished."""
        callbacks, self._on_settle = self._on_settle, []
        if self.state == "ready":
            self._use_compiled, self.state = True, "compiled"
            log.info("forward switched to the compiled layers (compile took %.1f s)", self.compile_seconds)
        elif self.state == "failed":
            for layer in self.model.model.layers:  # type: ignore[union-attr]
                layer.self_attn.backend = self._inner_backend
        for fn in callbacks:
            fn()

    def status(self) -> dict[str, Any]:
        """For stats and reports: state, compiled steps, compile seconds, error."""
        return {"state": self.state, "compiled_steps": self.compiled_steps, "compile_seconds": self.compile_seconds,
                "eager_prefill_steps": self.eager_prefill_steps, "error": self.error}

def build_forward(config: Any, model: torch.nn.Module, backend: AttentionBackend,
                  layer_kv_caches: list[torch.Tensor]) -> Any:
    """The runner's text forward: a CompiledForward where compiling applies (already compiled under
    PDCLUSTER_COMPILE_START=wait; under background, compiled once `release_and_start` started it),
    else the model itself. A model the compiler cannot take runs eagerly (logged), never fails to start."""
    why = compile_unsupported(config, model, os.environ.get("PDCLUSTER_COMPILE", "auto"))
    if why is not None:
        log.info("forward runs eagerly: %s", why)
        return model
    background = compile_start_policy() == "background"
    inner = model.model.layers[0].self_attn.backend  # type: ignore[union-attr, index]
    compiled = CompiledForward(model, backend, layer_kv_caches)
    if background:
        return compiled
    try:
        compiled.compile()
    except Exception as e:  # noqa: BLE001 - any compiler failure: fall back, the engine still works
        log.warning("torch.compile of the forward failed, running eagerly: %s: %s", type(e).__name__, e)
        for layer in model.model.layers:  # type: ignore[union-attr]
            layer.self_attn.backend = inner
        return model
    compiled.state, compiled._use_compiled = "compiled", True
    compiled.compile_done.set()
    log.info("forward compiled in %.1f s (%s=wait)", compiled.compile_seconds, START_ENV)
    return compiled


def release_and_start(forward: Any, model: torch.nn.Module) -> int:
    """After build_forward: cpu_gemm.release_plain_weights as far as nothing reads them now, then a
    background compile starts (after: the trace never sees a weight being released). While it runs
    the LM head's packed_now() (is_compiling() is process-wide) multiplies its plain weight, so that
    one goes at the switch or the failure, on the engine thread; the layers' go now. Returns the
    bytes freed now."""
    if not isinstance(forward, CompiledForward) or forward.state != "eager":
        return release_plain_weights(model)

    def release_rest() -> None:
        freed = release_plain_weights(model)
        if freed:
            log.info("released %.1f MiB more plain weights (the LM head's)", freed / 2**20)

    forward._on_settle.append(release_rest)
    freed = release_plain_weights(model.model.layers)  # type: ignore[union-attr, arg-type]
    forward.start_background()
    log.info("forward runs eagerly until the compile thread is done (%s=background)", START_ENV)
    return freed
