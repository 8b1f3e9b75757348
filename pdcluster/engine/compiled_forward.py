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
torch.compile).

Attention stays eager: every layer's `Attention.backend` is wrapped (`_TracedAttention`); eagerly
the wrapper calls the real backend unchanged, but while dynamo traces it emits one opaque custom op,
`pdcluster::paged_attention(q, k, v, scale, window)`. The op reads the step's metadata, KV cache and
backend from a ContextVar set around the layer loop, so neither the metadata (Python lists that
change every step) nor the KV cache (written in place) enter the graph: no guard on them, no
recompile per step, no functionalised copy of the cache. Compiled artefacts go to inductor's FX
graph cache under TORCHINDUCTOR_CACHE_DIR (default $PDCLUSTER_HOME/inductor, ~/.cache/pdcluster).
"""

from __future__ import annotations

import contextvars
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from pdcluster.models.layers.attention_backend import AttentionBackend, AttentionMetadata
from pdcluster.models.layers.cpu_gemm import CURRENT_LAYER, name_packed_layers

log = logging.getLogger(__name__)

AUTO_MIN_PARAMS = 50_000_000  # PDCLUSTER_COMPILE=auto: smaller models do not repay the compile
# What the traced layers get for their cache: the op reads the real one from the step.
_NO_KV = (None, None)


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
        if torch.compiler.is_compiling():
            return torch.ops.pdcluster.paged_attention(q, k, v, scale, sliding_window or 0)
        return self.inner.forward(q, k, v, k_cache, v_cache, meta, scale, sliding_window)


def cache_dir() -> str:
    """Inductor's cache folder: TORCHINDUCTOR_CACHE_DIR if set, else $PDCLUSTER_HOME/inductor
    (~/.cache/pdcluster/inductor). Put in the environment: inductor reads it there."""
    if not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        home = os.environ.get("PDCLUSTER_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "pdcluster")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(home, "inductor")
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


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
    """Callable like the model: (input_ids, positions, kv_caches, meta) -> hidden (T, H)."""

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, layer_kv_caches: list[torch.Tensor]
                 ) -> None:
        cache_dir()
        # One process may build engines of several shapes (tests, benchmarks): each adds variants
        # of the same layer code; past the limit dynamo would silently run it eagerly.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.model, self.backend, self.layer_kv_caches = model, backend, layer_kv_caches
        decoder = model.model  # type: ignore[union-attr]
        traced = _TracedAttention(backend)
        for layer in decoder.layers:
            layer.self_attn.backend = traced
            name_packed_layers(layer)  # its packed linears trace as the packed_linear op
        self._layers = [torch.compile(layer, dynamic=None, fullgraph=True) for layer in decoder.layers]
        self.compiled_steps = 0  # steps (warm-up included) that ran the compiled layers

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Any,
                 meta: AttentionMetadata) -> torch.Tensor:
        if meta.is_decode_only:  # eager: compiling decode did not pay (module docstring)
            return self.model(input_ids, positions, kv_caches, meta)
        return self.compiled(input_ids, positions, meta)

    def compiled(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
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
        step = _Step(self.backend, meta, self.layer_kv_caches)
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

    def warm_up(self) -> None:
        """Compile now (start-up), on a 2-token step that writes nothing (slots -1)."""
        dev = self.layer_kv_caches[0].device
        meta = AttentionMetadata(
            num_reqs=2, num_tokens=2, query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32, device=dev),
            seq_lens=torch.ones(2, dtype=torch.int32, device=dev), context_lens=torch.zeros(2, dtype=torch.int32,
                                                                                              device=dev),
            block_tables=torch.zeros(2, 1, dtype=torch.int32, device=dev),
            slot_mapping=torch.full((2,), -1, dtype=torch.int64, device=dev), max_query_len=1, max_seq_len=1,
            query_lens_cpu=[1, 1], seq_lens_cpu=[1, 1], context_lens_cpu=[0, 0])
        ids = torch.zeros(2, dtype=torch.int64, device=dev)
        with torch.inference_mode():
            self.compiled(ids, ids.clone(), meta)


def build_forward(config: Any, model: torch.nn.Module, backend: AttentionBackend,
                  layer_kv_caches: list[torch.Tensor]) -> Any:
    """The runner's text forward: a warmed-up CompiledForward where compiling applies, else the
    model itself. A model the compiler cannot take runs eagerly (logged), never fails to start."""
    why = compile_unsupported(config, model, os.environ.get("PDCLUSTER_COMPILE", "auto"))
    if why is not None:
        log.info("forward runs eagerly: %s", why)
        return model
    inner = model.model.layers[0].self_attn.backend  # type: ignore[union-attr, index]
    try:
        compiled = CompiledForward(model, backend, layer_kv_caches)
        compiled.warm_up()
    except Exception as e:  # noqa: BLE001 - any compiler failure: fall back, the engine still works
        log.warning("torch.compile of the forward failed, running eagerly: %s: %s", type(e).__name__, e)
        for layer in model.model.layers:  # type: ignore[union-attr]
            layer.self_attn.backend = inner
        return model
    return compiled
