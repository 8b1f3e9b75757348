"""Build a model and fill it from a safetensors checkpoint (single file or sharded).

Every checkpoint tensor goes through its parameter's `weight_loader` as a lazy safetensors slice
(`get_slice`): the loader reads only this TP rank's part of it from the file and converts the
dtype (layers/weight_slice.py). q/k/v and gate/up are fused here, at load time, so the forward pass
runs one matmul for each (a checkpoint that ships them fused, Phi-3's qkv_proj / gate_up_proj, is
split back into its projections by row ranges, `fused_checkpoint_rows`, so TP shards it alike); an MoE layer's per-expert tensors (`...experts.<e>.gate_proj.weight`,
Mixtral's `w1/w3/w2`) are stacked into its `experts.w13_weight` / `experts.w2_weight`. Tensors the model has no parameter for (e.g. rotary `inv_freq`) are
ignored; parameters no tensor filled are an error that names them.

After loading, `load_model` packs the linear layers' and the LM head's weights for oneDNN where
that is exact (CPU, bfloat16: layers/cpu_gemm.py; PDCLUSTER_CPU_PREPACK=0 turns it off). Loading
again drops the packed copies first, so a stale copy never multiplies.
"""

from __future__ import annotations

import json
import logging
import pathlib
import re
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from pdcluster.models.decoder import STACKED_PARAMS
from pdcluster.models.hf_config import ModelConfig, check_weights_exist
from pdcluster.models.layers.attention_backend import AttentionBackend
from pdcluster.models.layers.cpu_gemm import drop_packed, prepack_model
from pdcluster.models.layers.fused_moe import EXPERT_PARTS
from pdcluster.models.layers.weight_slice import rows, shape_of
from pdcluster.models.registry import get_model_class

logger = logging.getLogger(__name__)

_INDEX_FILE = "model.safetensors.index.json"
_EMBED, _LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$")
# safetensors dtype names a weight may have: anything else (F8_E4M3, I8, U8, I32 ...) is a
# quantized code, which read as a plain weight would give wrong tokens.
_WEIGHT_DTYPES = ("F32", "BF16", "F16", "F64")
ShardId = str | int | tuple[int, int] | None


def load_model(config: ModelConfig, attn_backend: AttentionBackend, ops_backend: str = "torch",
               device: str | torch.device = "cpu", tp_rank: int = 0, tp_size: int = 1) -> nn.Module:
    """Instantiate `config.architecture` directly on `device` and load its weights."""
    cls = get_model_class(config.architecture)
    with torch.device(device):
        model = cls(config, attn_backend, ops_backend=ops_backend, tp_rank=tp_rank, tp_size=tp_size)
    load_weights(model, config.model_path)
    packed, candidates = prepack_model(model)  # after loading: packs the loaded values
    logger.debug("oneDNN pre-packed %d of %d linear weights", packed, candidates)
    return model.eval()


def checkpoint_files(path: str | pathlib.Path) -> list[pathlib.Path]:
    root = pathlib.Path(path)
    check_weights_exist(root)
    index = root / _INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = [root / f for f in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{_INDEX_FILE} lists shard(s) that do not exist: {missing}")
        return files
    return sorted(root.glob("*.safetensors"))


def iter_checkpoint(path: str | pathlib.Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one at a time, so peak host memory stays ~one tensor above the model."""
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def iter_checkpoint_slices(path: str | pathlib.Path) -> Iterator[tuple[str, Any]]:
    """Yield (name, lazy slice); nothing is read until the consumer indexes the slice, and then
    only the indexed part. A slice is valid only until the next item (its file may close)."""
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_slice(name)


def _map_name(name: str, renames: tuple[tuple[str, str], ...] = ()) -> tuple[str, ShardId]:
    """Checkpoint name -> (our parameter name, shard id) using the fused projection table."""
    for theirs, ours in renames:
        name = name.replace(theirs, ours)
    expert = _EXPERT.match(name)
    if expert and expert.group(3) in EXPERT_PARTS:
        prefix, index, part = expert.group(1), int(expert.group(2)), EXPERT_PARTS[expert.group(3)]
        return f"{prefix}.{'w2' if part == 2 else 'w13'}_weight", (index, part)
    for fused, part, shard_id in STACKED_PARAMS:
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{fused}."), shard_id
    return name, None


def _fused_rows(model: nn.Module, name: str) -> list[tuple[str | int, int, int]] | None:
    rows_of = getattr(model, "fused_checkpoint_rows", None)
    return rows_of(name) if rows_of is not None else None


def _check_fused_rows(ckpt_name: str, tensor: Any, splits: list[tuple[str | int, int, int]]) -> None:
    want = sum(length for _, _, length in splits)
    have = shape_of(tensor)[0]
    if have != want:
        raise ValueError(f"checkpoint tensor {ckpt_name!r} has {have} rows; the config's projections need {want}")


def _unmap_name(param_name: str, shard_id: ShardId) -> str:
    if isinstance(shard_id, tuple):  # an expert's tensor, in the Qwen-MoE spelling
        part = ("gate_proj", "up_proj", "down_proj")[shard_id[1]]
        return re.sub(r"\.w(13|2)_weight$", f".{shard_id[0]}.{part}.weight", param_name)
    for fused, part, sid in STACKED_PARAMS:
        if sid == shard_id and f".{fused}." in param_name:
            return param_name.replace(f".{fused}.", f".{part}.")
    return param_name


def _required_shards(params: dict[str, nn.Parameter]) -> set[tuple[str, ShardId]]:
    required: set[tuple[str, ShardId]] = set()
    for name, param in params.items():
        shards = getattr(param, "required_shards", None)  # stacked experts list theirs
        if shards is None:
            shards = [sid for fused, _, sid in STACKED_PARAMS if f".{fused}." in name] or [None]
        required.update((name, sid) for sid in shards)
    return required


def load_weights(model: nn.Module, path: str | pathlib.Path) -> None:
    # named_parameters() lists a tied lm_head weight once, under the embedding's name.
    params = dict(model.named_parameters())
    drop_packed(model)  # a tied LM head's copy is not dropped by the embedding's loader
    renames = getattr(model, "CHECKPOINT_RENAMES", ())
    loaded: set[tuple[str, ShardId]] = set()
    ignored: list[str] = []
    for ckpt_name, tensor in iter_checkpoint_slices(path):
        name, shard_id = _map_name(ckpt_name, renames)
        param = params.get(name)
        if param is None:
            ignored.append(ckpt_name)
            continue
        stored = tensor.get_dtype()
        if stored not in _WEIGHT_DTYPES:
            raise ValueError(f"checkpoint tensor {ckpt_name!r} is stored as {stored}: quantized weights are not "
                             f"supported (weights must be one of {list(_WEIGHT_DTYPES)})")
        splits = _fused_rows(model, name) if shard_id is None else None
        if splits:  # the checkpoint fused the projections itself (Phi-3): one loader call per projection
            _check_fused_rows(ckpt_name, tensor, splits)
            for sid, start, length in splits:
                param.weight_loader(param, rows(tensor, start, length), sid)
                loaded.add((name, sid))
            continue
        param.weight_loader(param, tensor, shard_id)
        loaded.add((name, shard_id))
    if _LM_HEAD in params and (_LM_HEAD, None) not in loaded:
        # No lm_head in the checkpoint although tie_word_embeddings is false: tie it by copying.
        for ckpt_name, tensor in iter_checkpoint_slices(path):
            if ckpt_name == _EMBED:
                params[_LM_HEAD].weight_loader(params[_LM_HEAD], tensor)
                loaded.add((_LM_HEAD, None))
                break
    if ignored:
        logger.debug("ignored %d checkpoint tensors without a parameter: %s", len(ignored), ignored[:8])
    missing = sorted(_unmap_name(n, s) for n, s in _required_shards(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint {str(path)!r} is missing {len(missing)} required tensor(s): {missing[:10]}")
