"""Decode steps of a dense decoder on the CPU as one C call (kernels/decode_step_cpu.py).

Why: at batch 1 the eager step of the 125M bench Llama spends ~6-7 ms of its ~15-20 ms in Python
(module calls, tensor checks, views, ctypes argument conversion) around ~100 kernel calls that
read the weights; on a 2-core CPU that is a third of the step, and no weight layout can win it
back. The C driver runs the same kernels in the same order on the same arguments, so its output
(and what it writes into the KV cache) is bit for bit the eager step's; a test holds it to that.

When: a decode-only step (one new token per request) of at most cpu_gemv.max_rows requests,
outside a dynamo trace, on a model whose every layer is the plain pre-norm block the driver knows:
the "torch" ops backend's C kernels, the torch attention backend over a float32 or bfloat16 paged
cache, a fused qkv projection with or without per-head q/k norms (Qwen3), rotary or none, a gated MLP (no MoE),
tensor parallel size 1, a bf16 decode copy on every linear (cpu_gemv), and no forward hooks on
the layers but a KV connector's (which read neither inputs nor outputs: run all before the call,
all after it, in layer order). Anything else, or
PDCLUSTER_CPU_DECODE_STEP=0, runs the eager layers as before. The plan (the descriptors) is
built on first use and rebuilt when a weight's decode copy or the KV cache changes.

A bfloat16 model (a CPU that computes in bf16) runs the same call in the kernels' bf16 mode:
float32 buffers that hold bfloat16 values, rounded where the eager layers' bf16 ops round
(csrc/decode_step_cpu.c), over tiles of the model's own bf16 weights; its norm weights and biases
are widened once into the plan (exact). A weight load renews every linear's decode copy, which
rebuilds the plan, so the widened copies follow a reload too.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import Any

import torch

from pdcluster.env_flags import env_enabled
from pdcluster.kernels import decode_step_cpu, gemv_bf16_cpu
from pdcluster.models.layers import cpu_gemv
from pdcluster.models.layers.attention_backend import AttentionMetadata
from pdcluster.models.layers.mlp import MLP

log = logging.getLogger(__name__)

ENV = "PDCLUSTER_CPU_DECODE_STEP"  # "0": eager layers for every decode step
_CACHE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_ACT_DTYPES = (torch.float32, torch.bfloat16)  # the model's compute dtype: its norm weights' dtype
_MAX_ROW, _MAX_Q_HEADS = 4096, 256  # csrc/paged_decode_cpu.c's limits


@dataclass
class _Plan:
    key: tuple[Any, ...]  # what the descriptors point into: rebuilt when any of it changes
    model: decode_step_cpu.ModelDesc
    layers: ctypes.Array
    scratch: int  # floats per row
    dtype: torch.dtype  # the hidden states' dtype the plan takes (the model's compute dtype)
    keep: list[torch.Tensor]  # float32 copies of a bf16 model's norm weights and biases: what `layers` points at


def _linears(decoder: Any) -> list[Any]:
    """Every linear the descriptors read, in layer order (a MoE block has no gate_up/down: its
    layer is refused anyway, and None stands in)."""
    out: list[Any] = []
    for layer in decoder.layers:
        a, m = layer.self_attn, layer.mlp
        out += [a.qkv_proj, a.o_proj, getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)]
    return out


def _weights_key(linears: list[Any]) -> tuple[int, ...]:
    """Identity of every decode copy the descriptors point at: a reload or a dropped copy changes
    it. (Plain instance attributes: no nn.Module __getattr__ on this per-step path.)"""
    return tuple(id(getattr(lin, "gemv_weight", None)) for lin in linears)


def why_not(decoder: Any) -> str | None:
    """Why this decoder's decode steps cannot take the driver, or None when they can."""
    if not env_enabled(ENV):
        return f"{ENV}=0"
    if not decode_step_cpu.available():
        return "a C kernel is unavailable (kernels/native.py logged why)"
    first = decoder.layers[0].self_attn if len(decoder.layers) else None
    if first is None:
        return "no layers"
    act = decoder.norm.weight.dtype
    if act not in _ACT_DTYPES:
        return f"a {act} model (float32 and bfloat16 are taken)"
    for i, layer in enumerate(decoder.layers):
        a, m = layer.self_attn, layer.mlp
        if not isinstance(m, MLP):
            return f"layer {i} is not a dense gated MLP"
        if layer.residual_multiplier != decoder.layers[0].residual_multiplier:
            return "layers of different residual multipliers"
        if a.q_norm is not None and (a.q_norm.weight.dtype != act or a.k_norm.weight.dtype != act
                                     or a.q_norm.eps != decoder.norm.eps or a.k_norm.eps != decoder.norm.eps):
            return f"layer {i}'s per-head q/k norms are not {act} or of another eps"
        # By its registry name, not its class: importing torch_attention here would close an import
        # circle (torch_attention -> kv_quant -> loader -> decoder -> this module).
        if a.backend.name != "torch":  # compiled_forward's wrapper carries its inner backend's name
            return f"layer {i}'s attention backend is {a.backend.name!r}, not 'torch'"
        if getattr(layer.input_layernorm._ops, "name", None) != "torch":
            return f"layer {i}'s ops backend is not 'torch'"
        for name, lin in (("qkv_proj", a.qkv_proj), ("o_proj", a.o_proj), ("gate_up_proj", m.gate_up_proj),
                          ("down_proj", m.down_proj)):
            if lin.tp_size != 1:
                return "tensor parallel"
            if lin.gemv_weight is None:
                return f"layer {i}'s {name} has no bf16 decode copy ({cpu_gemv.skip_reason(lin.weight) or 'values'})"
            if lin.weight.dtype != act or (lin.bias is not None and lin.bias.dtype != act):
                return f"layer {i}'s {name} is not {act} like the norms"
        if (a.num_heads, a.num_kv_heads, a.head_dim) != (first.num_heads, first.num_kv_heads, first.head_dim):
            return "layers of different attention shapes"
        if a.num_kv_heads * a.head_dim > _MAX_ROW or a.num_heads > _MAX_Q_HEADS:
            return "attention shape past the paged kernel's limits"
        rot = a.rotary_emb
        if rot is not None and (rot.cos_sin_cache.dtype != torch.float32 or rot.cos_sin_cache.shape[1] > a.head_dim):
            return "rotary table not float32 or wider than a head"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if norm.weight.dtype != act or norm.eps != decoder.norm.eps:
                return f"norm weights not all {act} or of different eps"
    if len({id(layer.self_attn.rotary_emb) for layer in decoder.layers if layer.self_attn.rotary_emb}) > 1:
        return "layers with different rotary tables"
    layouts = {lin.gemv_weight.layout for lin in _linears(decoder)}
    if len(layouts) > 1:
        return f"decode copies in different layouts {sorted(layouts)}"
    if layouts == {gemv_bf16_cpu.PAIRS} and act != torch.bfloat16:
        return "bf16-pair decode copies under a float32 model"  # that kernel takes bf16-valued rows only
    if decode_step_cpu.kernel_pointers(layouts.pop()) is None:
        return "no product kernel for the decode copies' layout"
    return None


class DecodeStep:
    """The driver for one DecoderModel: `run` returns the final hidden states of a decode step, or
    None when this step (or this model) does not take it."""

    def __init__(self) -> None:
        self._plan: _Plan | None = None
        self._refused: tuple[tuple[int, ...], str] | None = None  # (weights key, why) once checked
        self._linears: list[Any] | None = None  # the decoder's linears, found once (layers are fixed)
        self.steps = 0  # decode steps run by the driver (tests and benchmarks read it)

    def run(self, decoder: Any, hidden: torch.Tensor, positions: torch.Tensor, kv_caches: Any,
            meta: AttentionMetadata) -> torch.Tensor | None:
        rows = hidden.shape[0]
        # The trace check first: dynamo cannot trace max_rows' cached CPU check.
        if (torch.compiler.is_dynamo_compiling() or rows == 0 or rows > cpu_gemv.max_rows(hidden.dtype)
                or meta.max_query_len != 1 or meta.num_tokens != meta.num_reqs or not hidden.is_cpu):
            return None
        plan = self._get_plan(decoder, kv_caches)  # a refused model stops here, on a cached answer
        hooks = None if plan is None or plan.dtype != hidden.dtype else layer_hooks(decoder)
        if plan is None or hooks is None:
            return None
        # The driver overwrites it with the final norm's output; a bf16 step's, widened (exact).
        out = hidden.contiguous().clone() if hidden.dtype == torch.float32 else hidden.float()
        pos = positions.to(torch.int64).contiguous()  # no copy when it already is
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        tables = meta.block_tables.to(torch.int32).contiguous()
        lens = meta.seq_lens.to(torch.int64).contiguous()
        bs = plan.model.block_size
        if meta.max_seq_len > tables.shape[1] * bs:
            raise ValueError(f"decode step: a seq_len of {meta.max_seq_len} needs more than the "
                             f"{tables.shape[1]} blocks of {bs} its table holds")
        scratch = torch.empty(plan.scratch * rows, dtype=torch.float32)
        pre, post = hooks
        for layer, hook in pre:  # a KV connector's wait_for_layer_load, every layer before the call
            hook(layer, ())
        rc = decode_step_cpu.run(plan.model, plan.layers, out.data_ptr(), rows, pos.data_ptr(), slots.data_ptr(),
                                 tables.data_ptr(), tables.stride(0), lens.data_ptr(), scratch.data_ptr(),
                                 torch.get_num_threads())
        if rc != 0:
            # A kernel refused (a position outside the rope table: -2) or ran out of memory (-3):
            # the eager layers take the step and raise or fall back as they do. What the driver
            # wrote so far is this step's K/V at this step's slots, which they write again, equal.
            log.warning("decode step: a CPU kernel returned %d; this step runs the eager layers", rc)
            return None
        for layer, hook in post:  # its save_kv_layer: each layer's cache is final once the call returns
            hook(layer, (), None)
        self.steps += 1
        return out if plan.dtype == torch.float32 else out.to(plan.dtype)  # exact: bf16 values

    def _get_plan(self, decoder: Any, kv_caches: Any) -> _Plan | None:
        if self._linears is None:
            self._linears = _linears(decoder)
        weights = _weights_key(self._linears)
        if self._refused is not None and self._refused[0] == weights:
            return None
        k0 = kv_caches[0]
        key = (weights, id(kv_caches), k0.data_ptr(), k0.dtype, tuple(k0.shape))
        if self._plan is not None and self._plan.key == key:
            return self._plan
        why = why_not(decoder)
        if why is None and (k0.dtype not in _CACHE_DTYPES or not all(kv_caches[i].is_contiguous()
                                                                    for i in range(len(decoder.layers)))):
            why = f"KV cache of {k0.dtype} (float32 or bfloat16, contiguous, are taken)"
        if why is not None:
            log.info("decode steps run the eager layers: %s", why)
            self._refused, self._plan = (weights, why), None
            return None
        self._plan = _build(decoder, kv_caches, key)
        return self._plan


_Hook = tuple[torch.nn.Module, Any]


def layer_hooks(decoder: Any) -> tuple[list[_Hook], list[_Hook]] | None:
    """The layers' forward pre-hooks and hooks, in layer order, when every one is marked
    `args_free` (reads neither the layer's inputs nor its output: engine/connector_hooks.py's) and
    no global module hook is set; else None (the eager layers must run for the hooks to see their
    arguments)."""
    from torch.nn.modules import module as nn_module

    if nn_module._global_forward_pre_hooks or nn_module._global_forward_hooks:
        return None
    pre: list[_Hook] = []
    post: list[_Hook] = []
    for layer in decoder.layers:
        for hooks, into in ((layer._forward_pre_hooks, pre), (layer._forward_hooks, post)):
            for hook in hooks.values():
                if not getattr(hook, "args_free", False):
                    return None
                into.append((layer, hook))
    return pre, post


def _ptr(t: torch.Tensor | None, keep: list[torch.Tensor]) -> int | None:
    """t's float32 data: t's own, or (a bf16 model) a widened copy the plan keeps alive."""
    if t is None:
        return None
    if t.dtype != torch.float32:
        t = t.float()
        keep.append(t)
    return t.data_ptr()


def _build(decoder: Any, kv_caches: Any, key: tuple[Any, ...]) -> _Plan:
    a0, m0 = decoder.layers[0].self_attn, decoder.layers[0].mlp
    rot = next((layer.self_attn.rotary_emb for layer in decoder.layers if layer.self_attn.rotary_emb), None)
    k0 = kv_caches[0]
    dtype = decoder.norm.weight.dtype
    ptrs = decode_step_cpu.kernel_pointers(a0.qkv_proj.gemv_weight.layout)
    assert ptrs is not None
    keep: list[torch.Tensor] = []
    model = decode_step_cpu.ModelDesc(
        hidden=decoder.norm.weight.shape[0], inter=m0.down_proj.in_features, hq=a0.num_heads, hk=a0.num_kv_heads,
        d=a0.head_dim, n_layers=len(decoder.layers), block_size=k0.shape[2], cache_dtype=_CACHE_DTYPES[k0.dtype],
        rot=0 if rot is None else rot.cos_sin_cache.shape[1], max_pos=0 if rot is None else rot.cos_sin_cache.shape[0],
        neox=int(rot is None or rot.is_neox_style), bf16=int(dtype == torch.bfloat16), eps=decoder.norm.eps,
        scale=a0.scale, res_mult=decoder.layers[0].residual_multiplier,
        cos_sin=None if rot is None else rot.cos_sin_cache.data_ptr(),
        final_ln=_ptr(decoder.norm.weight, keep), **ptrs)
    layers = (decode_step_cpu.LayerDesc * len(decoder.layers))()
    for i, layer in enumerate(decoder.layers):
        a, m = layer.self_attn, layer.mlp
        kv = kv_caches[i]  # (2, num_blocks, block_size, Hk, D)
        layers[i] = decode_step_cpu.LayerDesc(
            ln1=_ptr(layer.input_layernorm.weight, keep), ln2=_ptr(layer.post_attention_layernorm.weight, keep),
            qkv=a.qkv_proj.gemv_weight.data.data_ptr(), o=a.o_proj.gemv_weight.data.data_ptr(),
            gate_up=m.gate_up_proj.gemv_weight.data.data_ptr(), down=m.down_proj.gemv_weight.data.data_ptr(),
            qkv_bias=_ptr(a.qkv_proj.bias, keep), o_bias=_ptr(a.o_proj.bias, keep),
            gate_up_bias=_ptr(m.gate_up_proj.bias, keep), down_bias=_ptr(m.down_proj.bias, keep),
            q_norm=None if a.q_norm is None else _ptr(a.q_norm.weight, keep),
            k_norm=None if a.k_norm is None else _ptr(a.k_norm.weight, keep), k_cache=kv[0].data_ptr(),
            v_cache=kv[1].data_ptr(), window=int(a.sliding_window or 0), rotary=int(a.rotary_emb is not None))
    return _Plan(key, model, layers, decode_step_cpu.scratch_floats(model, 1), dtype, keep)
