"""TPGroup: the collectives of one tensor-parallel instance, on process-group objects we own.

We build torch's backend objects directly (ProcessGroupGloo / ProcessGroupNCCL over a TCPStore)
instead of `init_process_group`: no process-global default group, so one process can start,
shut down and start again several TP engines (tests do), and nothing else in the process can
issue a collective on our group by accident.

Two groups per instance, both over the same store (key prefixes keep them apart):

    model group    gloo (CPU) | NCCL (CUDA)   all-reduce / all-gather inside the forward pass;
                                              short timeout: a peer that stops answering mid-step
                                              is dead, and the step must fail, not hang
    control group  gloo, CPU tensors          rank 0's step broadcast; long timeout, because
                                              the other ranks wait in it for as long as the
                                              engine is idle (liveness comes from elsewhere:
                                              process sentinels and the parent pipe)

Time spent inside model-group collectives is accumulated (`stats`), so the benchmark can report
the per-step communication cost. On CUDA it is the host-side time (NCCL work is asynchronous).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pdcluster.distributed.seal_listeners import CONSTRUCTION_LOCK, listening_fds, seal_new_listeners

# The control group's timeout: an idle engine may wait in the step broadcast for this long.
CONTROL_TIMEOUT_S = 7 * 24 * 3600.0


@dataclass
class CollectiveStats:
    num_collectives: int = 0
    collective_s: float = 0.0
    bytes: int = 0

    def as_dict(self) -> dict[str, float]:
        return {"num_collectives": self.num_collectives, "collective_s": self.collective_s,
                "collective_bytes": self.bytes}


def _gloo(store: Any, rank: int, size: int, timeout_s: float) -> Any:
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    # Pin gloo to loopback: the default resolves the hostname, which fails in some containers and
    # could pick an interface other processes on the network can reach.
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(store, rank, size, opts)


def _nccl(store: Any, rank: int, size: int, timeout_s: float) -> Any:
    # NCCL's bootstrap and proxy listeners bind the interface NCCL picks (the first non-loopback
    # one by default); the ranks of one instance share this host, so loopback is enough. An
    # explicit NCCL_SOCKET_IFNAME (a multi-node deployment) wins.
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    return dist.ProcessGroupNCCL(store, rank, size, opts)


class TPGroup:
    """The collectives the model layers and the step broadcast need; nothing more."""

    def __init__(self, store: Any, rank: int, world_size: int, device: str, timeout_s: float) -> None:
        self.rank, self.world_size = rank, world_size
        self.device = device
        model_store = dist.PrefixStore("tp/model/", store)
        ctrl_store = dist.PrefixStore("tp/ctrl/", store)
        with CONSTRUCTION_LOCK:
            before = listening_fds()
            if device == "cuda":
                self._model = _nccl(model_store, rank, world_size, timeout_s)
            else:
                self._model = _gloo(model_store, rank, world_size, timeout_s)
            self._ctrl = _gloo(ctrl_store, rank, world_size, CONTROL_TIMEOUT_S)
            # gloo's listeners have served their purpose (the mesh is connected) and would keep
            # an fd for every later connection: closed to new ones (seal_listeners.py).
            self.sealed_ports = seal_new_listeners(before)
        self.stats = CollectiveStats()

    # -- model collectives (called from the layers) ----------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place; returns t."""
        t0 = time.perf_counter()
        self._model.allreduce([t]).wait()
        self._count(t0, t)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `t` (same shape everywhere) along dim, in rank order."""
        t0 = time.perf_counter()
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        self._model.allgather([parts], [t]).wait()
        self._count(t0, t)
        return torch.cat(parts, dim=dim)

    def _count(self, t0: float, t: torch.Tensor) -> None:
        self.stats.collective_s += time.perf_counter() - t0
        self.stats.num_collectives += 1
        self.stats.bytes += t.numel() * t.element_size()

    # -- control plane ------------------------------------------------------------------------------
    def broadcast_bytes(self, data: bytes | None, max_len: int) -> bytes:
        """Rank 0 sends `data`; every other rank passes None and gets it. Two broadcasts: the
        length (int64), then the payload as a uint8 tensor. Receivers refuse a length over
        max_len before allocating anything."""
        n = torch.zeros(1, dtype=torch.int64)
        if self.rank == 0:
            assert data is not None
            if len(data) > max_len:
                raise ValueError(f"control message of {len(data)} bytes exceeds {max_len}")
            n[0] = len(data)
        self._ctrl.broadcast([n], _root(0)).wait()
        length = int(n.item())
        if not 0 < length <= max_len:
            raise ValueError(f"control message length {length} outside (0, {max_len}]")
        if self.rank == 0:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)  # type: ignore[arg-type]
        else:
            buf = torch.empty(length, dtype=torch.uint8)
        self._ctrl.broadcast([buf], _root(0)).wait()
        return data if self.rank == 0 else buf.numpy().tobytes()  # type: ignore[return-value]

    def gather_bytes(self, data: bytes, max_len: int) -> list[bytes]:
        """Every rank contributes `data`; every rank gets all contributions in rank order (an
        all-gather of lengths, then of payloads padded to the longest). Used for small reports
        (connector handshake metadata, per-step completion sets) on the control group."""
        if len(data) > max_len:
            raise ValueError(f"control message of {len(data)} bytes exceeds {max_len}")
        n = torch.tensor([len(data)], dtype=torch.int64)
        lens = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self._ctrl.allgather([lens], [n]).wait()
        sizes = [int(t.item()) for t in lens]
        if any(not 0 <= s <= max_len for s in sizes):
            raise ValueError(f"control message lengths {sizes} outside [0, {max_len}]")
        width = max(1, max(sizes))
        buf = torch.zeros(width, dtype=torch.uint8)
        if data:
            buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.empty(width, dtype=torch.uint8) for _ in range(self.world_size)]
        self._ctrl.allgather([parts], [buf]).wait()
        return [p[:s].numpy().tobytes() for p, s in zip(parts, sizes)]

    def barrier(self) -> None:
        """All ranks reached this point (control group, so it works before any model op)."""
        self._ctrl.broadcast([torch.zeros(1)], _root(0)).wait()

    def shutdown(self) -> None:
        """Release the backends' sockets / communicators. Best effort: a dead peer is fine."""
        for pg in (self._model, self._ctrl):
            try:
                pg.shutdown()
            except Exception:  # already failed groups may refuse; nothing to do
                pass


def _root(rank: int) -> Any:
    opts = dist.BroadcastOptions()
    opts.rootRank = rank
    return opts


def make_store(host: str, port: int, world_size: int, is_master: bool, timeout_s: float) -> Any:
    """The rendezvous store. The master passes port 0 and reads the bound port from `.port`, so
    there is no pick-a-free-port race.

    The master's listening socket is bound here, on `host` (loopback), and handed to TCPStore:
    given a host and port, TCPStore itself listens on every interface (`*:PORT`), where anyone
    could write rendezvous keys of an unauthenticated store."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if not is_master:
        return dist.TCPStore(host, port, world_size, False, timeout=timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.bind((host, port))
        if not ipaddress.ip_address(listener.getsockname()[0]).is_loopback:
            raise ValueError(f"the TP rendezvous must bind loopback, not {host!r}")
        listener.listen(max(64, 2 * world_size))
        bound = listener.getsockname()[1]
    except BaseException:
        listener.close()
        raise
    # The store owns the descriptor from here on (it closes it when destroyed).
    return dist.TCPStore(host, bound, world_size, True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=listener.detach())


def attach_tp_group(model: torch.nn.Module, group: TPGroup) -> int:
    """Set the communication hook (`tp_group`) of every layer that has one; returns how many."""
    n = 0
    for module in model.modules():
        if hasattr(module, "tp_group") and getattr(module, "tp_size", 1) > 1:
            module.tp_group = group
            n += 1
    return n
