"""Tensor-parallel linear layers (Megatron style).

Column parallel splits the output features across ranks (no communication); row parallel splits
the input features and sums the partial outputs with one all-reduce. Every parameter carries a
`weight_loader(param, loaded, shard_id=None)` that copies only this rank's slice of a full
checkpoint tensor, converting dtype on the way, so loading is identical for any TP size.

    QKV fused output rows (one rank):  [ q heads of rank | k heads of rank | v heads of rank ]
    gate_up fused output rows:         [ gate slice of rank | up slice of rank ]

KV heads over ranks (Hk global KV heads, t ranks), rows of the checkpoint's k_proj / v_proj:

    Hk >= t (split):      rank r holds heads [r*Hk/t, (r+1)*Hk/t)
        Hk=4, t=2:        k_proj rows  | h0 h1 | h2 h3 |
                                         rank0   rank1
    Hk < t (replicated):  rank r holds head r*Hk//t (t/Hk consecutive ranks share one head)
        Hk=1, t=2:        k_proj rows  |   h0    |      ranks 0 and 1 both read h0
        Hk=2, t=4:        k_proj rows  | h0 | h1 |      ranks 0,1 -> h0; ranks 2,3 -> h1

Each rank's q heads [r*Hq/t, (r+1)*Hq/t) attend to its KV head(s) with the usual GQA grouping,
because r*Hk//t is exactly the KV head of those q heads.

On CPU in bfloat16 each layer also holds a oneDNN-packed copy of its weight (`prepack()`, called
after loading: layers/cpu_gemm.py) and multiplies with it; the plain `weight` parameter stays
(the compiled graph, state readers and reloads use it). Loading into the weight drops the copy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from pdcluster.kernels.gemv_bf16_cpu import Bf16Tiles
from pdcluster.models.layers import cpu_gemv
from pdcluster.models.layers.cpu_gemm import PackedWeight, pack_weight
from pdcluster.models.layers.weight_slice import Loaded, narrow, shape_of, whole

if TYPE_CHECKING:
    from pdcluster.distributed.comm import TPComm


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size ({d})")
    return n // d


def _copy_into(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"checkpoint tensor for {name} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)  # copy_ converts to the parameter's dtype and device


def _check_dim(loaded: Loaded, dim: int, expected: int, name: str) -> None:
    # A wrong-size checkpoint tensor must fail loudly, not load a plausible-looking slice of it.
    got = shape_of(loaded)
    if len(got) <= dim or got[dim] != expected:
        raise ValueError(f"checkpoint tensor for {name} has shape {got}; dim {dim} should be {expected}")


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features  # local (this rank's) sizes
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self._load
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self._load
        else:
            self.register_parameter("bias", None)
        # oneDNN-packed copy of `weight` (a plain attribute: not a parameter, not in state_dict).
        self.packed_weight: PackedWeight | None = None
        # bfloat16 copy for decode-sized products when `weight` holds bf16 values (cpu_gemv).
        self.gemv_weight: Bf16Tiles | None = None
        # Path inside its decoder layer once compiled_forward traces it packed (cpu_gemm).
        self.compiled_name: str | None = None

    def _load(self, param: nn.Parameter, loaded: Loaded, shard_id: str | int | None = None) -> None:
        self.packed_weight = self.gemv_weight = None  # copies of the old values would be stale
        self.compiled_name = None
        self.weight_loader(param, loaded, shard_id)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: str | int | None = None) -> None:
        raise NotImplementedError

    def prepack(self) -> bool:
        """Pack the loaded weight for oneDNN where that is exact and available (cpu_gemm), and
        keep its bfloat16 decode copy where it holds bf16 values (cpu_gemv)."""
        self.gemv_weight = cpu_gemv.decode_copy(self.weight, self.bias)
        self.packed_weight = pack_weight(self.weight, self.bias)
        return self.packed_weight is not None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ weight.T (+ bias): through the bf16 decode copy or the packed copy where one serves
        x's rows, else F.linear."""
        if torch.compiler.is_dynamo_compiling() and self.compiled_name is not None:  # this thread traces
            # Traced: the opaque op multiplies with the packed weight at run time (cpu_gemm).
            return torch.ops.pdcluster.packed_linear(x, bias, self.compiled_name, self.out_features)
        return cpu_gemv.linear(self, x, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ReplicatedLinear(LinearBase):
    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: str | int | None = None) -> None:
        _copy_into(param.data, whole(loaded), type(self).__name__)


class ColumnParallelLinear(LinearBase):
    """y[:, rank's rows] = x @ W[rank's rows].T; the output stays sharded."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(in_features, _divide(out_features, tp_size, "output features"), bias, dtype,
                         tp_rank, tp_size)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: str | int | None = None) -> None:
        rows = param.shape[0]
        _check_dim(loaded, 0, rows * self.tp_size, type(self).__name__)
        _copy_into(param.data, narrow(loaded, 0, self.tp_rank * rows, rows), type(self).__name__)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate_up_proj);
    shard_id is the index of the projection in `output_sizes`."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, dtype: torch.dtype,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        self.output_sizes = [_divide(s, tp_size, "output features") for s in output_sizes]  # local
        super().__init__(in_features, sum(output_sizes), bias, dtype, tp_rank, tp_size)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: str | int | None = None) -> None:
        assert isinstance(shard_id, int), "merged linear needs the index of the projection"
        size = self.output_sizes[shard_id]
        dst = param.data.narrow(0, sum(self.output_sizes[:shard_id]), size)
        _check_dim(loaded, 0, size * self.tp_size, f"gate_up shard {shard_id}")
        _copy_into(dst, narrow(loaded, 0, self.tp_rank * size, size), f"gate_up shard {shard_id}")


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; heads are split across ranks. With fewer KV heads than
    ranks each KV head is replicated on tp_size // num_kv_heads consecutive ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1) -> None:
        self.head_dim = head_dim
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads
        self.num_heads = _divide(num_heads, tp_size, "num_attention_heads")  # local
        if num_kv_heads >= tp_size:
            self.num_kv_heads = _divide(num_kv_heads, tp_size, "num_key_value_heads")
            self._kv_shard = tp_rank
        else:
            _divide(tp_size, num_kv_heads, "replicated KV heads")
            self.num_kv_heads = 1
            self._kv_shard = tp_rank * num_kv_heads // tp_size  # see the diagram above
        out_local = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        super().__init__(hidden_size, out_local * tp_size, bias, dtype, tp_rank, tp_size)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: str | int | None = None) -> None:
        if shard_id == "q":
            offset, size, shard = 0, self.q_size, self.tp_rank
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size, shard = self.kv_size, self._kv_shard
        else:
            raise ValueError(f"QKV shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        total = self.total_num_heads if shard_id == "q" else self.total_num_kv_heads
        _check_dim(loaded, 0, total * self.head_dim, f"qkv shard {shard_id}")
        dst = param.data.narrow(0, offset, size)
        _copy_into(dst, narrow(loaded, 0, shard * size, size), f"qkv shard {shard_id}")


class RowParallelLinear(LinearBase):
    """y = sum over ranks of x[:, rank's cols] @ W[:, rank's cols].T (+ bias once)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(_divide(in_features, tp_size, "input features"), out_features, bias, dtype,
                         tp_rank, tp_size)
        # The single TP communication hook: the process group the partial outputs are summed over.
        # None means no reduce (tp_size 1); pdcluster.distributed sets it when it starts TP.
        self.tp_group: TPComm | None = None

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: str | int | None = None) -> None:
        if param.dim() == 1:  # the bias is not split: added once, after the reduce
            _copy_into(param.data, whole(loaded), "row-parallel bias")
            return
        cols = param.shape[1]
        _check_dim(loaded, 1, cols * self.tp_size, type(self).__name__)
        _copy_into(param.data, narrow(loaded, 1, self.tp_rank * cols, cols), type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.matmul(x, self.bias)
        if self.tp_group is None:
            raise RuntimeError("RowParallelLinear with tp_size > 1 needs tp_group set before forward")
        out = self.matmul(x, None)  # (T, out): this rank's partial sum
        self.tp_group.all_reduce(out)
        return out if self.bias is None else out + self.bias
