"""TPComm: what a tensor-parallel layer asks of its communication hook (`layer.tp_group`).

The layers depend on this protocol only; `pdcluster.distributed.group.TPGroup` implements it
over torch process groups, and tests can pass a fake.
"""

from __future__ import annotations

from typing import Protocol

import torch


class TPComm(Protocol):
    rank: int
    world_size: int

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum t over the ranks, in place; returns t."""
        ...

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's t (same shape on every rank) concatenated along dim, in rank order."""
        ...
