"""Vocab-parallel token embedding and LM head.

The vocabulary is split into tp_size contiguous ranges of `ceil(V / tp_size)` rows (the last range
padded with zero rows). The embedding looks up ids of its range and zeros the rest, then the ranks
sum (all-reduce); the LM head computes the logits of its range and the ranks concatenate
(all-gather). With tp_size 1 both are a plain lookup / matmul.

    V=10, t=4: num_local=3   rank0 [0,3)  rank1 [3,6)  rank2 [6,9)  rank3 [9,10) + 2 zero rows
    all-gather: [r0 logits | r1 | r2 | r3 incl. 2 pad columns] -> cut to [:, :V]

On CPU in bfloat16 the LM head multiplies with a oneDNN-packed copy of its weight (`prepack()`,
layers/cpu_gemm.py). When tied, the embedding's plain weight stays for the lookup, so the packed
copy costs the embedding's bytes again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pdcluster.kernels.gemv_bf16_cpu import Bf16Tiles
from pdcluster.models.layers import cpu_gemv
from pdcluster.models.layers.cpu_gemm import PackedWeight, pack_weight
from pdcluster.models.layers.weight_slice import Loaded, narrow, shape_of

if TYPE_CHECKING:
    from pdcluster.distributed.comm import TPComm


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.num_local = -(-vocab_size // tp_size)
        self.vocab_start = tp_rank * self.num_local
        self.weight = nn.Parameter(torch.zeros(self.num_local, hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        # The TP communication hook; None means no reduce (tp_size 1), set by pdcluster.distributed.
        self.tp_group: TPComm | None = None

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: str | int | None = None) -> None:
        shape = shape_of(loaded)
        if shape != (self.vocab_size, param.shape[1]):
            raise ValueError(f"embedding tensor has shape {shape}, expected ({self.vocab_size}, {param.shape[1]})")
        rows = min(self.num_local, self.vocab_size - self.vocab_start)
        if rows > 0:  # a last rank can own only padding when V is tiny and t large
            param.data[:rows].copy_(narrow(loaded, 0, self.vocab_start, rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        if self.tp_group is None:
            raise RuntimeError("VocabParallelEmbedding with tp_size > 1 needs tp_group set before forward")
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_local)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)  # (T, H): rows of other ranks' ids are zero
        return self.tp_group.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden (N, H) -> logits (N, V) float32. Shares its weight with the embedding when tied."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(vocab_size, hidden_size, dtype, tp_rank, tp_size)
        self.weight.weight_loader = self._load
        # oneDNN-packed copy of `weight` (a plain attribute: not a parameter, not in state_dict).
        self.packed_weight: PackedWeight | None = None
        # bfloat16 copy for decode-sized products when `weight` holds bf16 values (cpu_gemv).
        self.gemv_weight: Bf16Tiles | None = None

    def _load(self, param: nn.Parameter, loaded: Loaded, shard_id: str | int | None = None) -> None:
        self.packed_weight = self.gemv_weight = None  # copies of the old values would be stale
        self.weight_loader(param, loaded, shard_id)

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight  # loaded through the embedding's loader, once
        self.packed_weight = self.gemv_weight = None

    def prepack(self) -> bool:
        """Pack the loaded (or tied) weight for oneDNN where that is exact and available, and keep
        its bfloat16 decode copy where it holds bf16 values (cpu_gemv)."""
        self.gemv_weight = cpu_gemv.decode_copy(self.weight)
        self.packed_weight = pack_weight(self.weight)
        return self.packed_weight is not None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = cpu_gemv.linear(self, hidden, None)  # (N, num_local)
        if self.tp_size > 1:
            if self.tp_group is None:
                raise RuntimeError("ParallelLMHead with tp_size > 1 needs tp_group set before forward")
            logits = self.tp_group.all_gather(logits, dim=-1)  # (N, num_local * tp_size)
        # Cast after the matmul (not before) to match transformers, which upcasts the logits.
        return logits[:, : self.vocab_size].float()
