"""Heterogeneous tensor parallelism: which producer ranks, and which heads of each, a consumer
rank reads, and which consumer ranks each producer rank waits for before it frees a lease.

    H global KV heads, P producer ranks, D consumer ranks; tp_ratio = signed ratio of the sizes:
        tp_ratio > 0:  D = tp_ratio * P   (each producer rank feeds tp_ratio consumer ranks)
        tp_ratio < 0:  P = -tp_ratio * D  (each consumer rank reads from -tp_ratio producer ranks)

A rank holds the heads KVCacheLayout.global_head_range() gives: H // T contiguous heads, or one
replicated head when T > H. A head replicated on several producer ranks is read once, from the
lowest such rank. A producer rank no consumer rank reads from (a replica) is still told "done",
by consumer rank p % D, so every producer rank's lease ends by notice, not only by expiry.
Both sides compute the same plan from (H, P, D).
"""

from __future__ import annotations

from dataclasses import dataclass


def tp_ratio(producer_tp: int, consumer_tp: int) -> int:
    """Signed ratio (see above); ValueError when neither size divides the other."""
    if producer_tp < 1 or consumer_tp < 1:
        raise ValueError(f"TP sizes must be positive, got {producer_tp} and {consumer_tp}")
    if consumer_tp % producer_tp == 0:
        return consumer_tp // producer_tp
    if producer_tp % consumer_tp == 0:
        return -(producer_tp // consumer_tp)
    raise ValueError(f"producer TP {producer_tp} and consumer TP {consumer_tp}: neither divides the other")


def head_range(total_heads: int, tp_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of the global heads rank holds (KVCacheLayout.global_head_range)."""
    if total_heads >= tp_size:
        n = total_heads // tp_size
        return rank * n, rank * n + n
    head = rank * total_heads // tp_size
    return head, head + 1


@dataclass(frozen=True)
class Piece:
    """Read heads [src_h0, src_h1) of producer rank `producer_rank` (local head indices) into
    heads [dst_h0, dst_h1) of this consumer rank."""

    producer_rank: int
    src_h0: int
    src_h1: int
    dst_h0: int
    dst_h1: int


def _owner(total_heads: int, producer_tp: int, head: int) -> int:
    """The producer rank a global head is read from (the lowest one holding it)."""
    for p in range(producer_tp):
        h0, h1 = head_range(total_heads, producer_tp, p)
        if h0 <= head < h1:
            return p
    raise ValueError(f"head {head} outside [0, {total_heads})")


def read_plan(total_heads: int, producer_tp: int, consumer_tp: int, consumer_rank: int) -> list[Piece]:
    tp_ratio(producer_tp, consumer_tp)
    c0, c1 = head_range(total_heads, consumer_tp, consumer_rank)
    pieces: list[Piece] = []
    for g in range(c0, c1):
        p = _owner(total_heads, producer_tp, g)
        p0 = head_range(total_heads, producer_tp, p)[0]
        src, dst = g - p0, g - c0
        last = pieces[-1] if pieces else None
        if last is not None and last.producer_rank == p and last.src_h1 == src and last.dst_h1 == dst:
            pieces[-1] = Piece(p, last.src_h0, src + 1, last.dst_h0, dst + 1)
        else:
            pieces.append(Piece(p, src, src + 1, dst, dst + 1))
    return pieces


def notify_ranks(total_heads: int, producer_tp: int, consumer_tp: int, consumer_rank: int) -> list[int]:
    """Producer ranks consumer_rank tells "done" (those it reads from, plus unread replicas)."""
    read_by_anyone = {pc.producer_rank for c in range(consumer_tp)
                      for pc in read_plan(total_heads, producer_tp, consumer_tp, c)}
    mine = {pc.producer_rank for pc in read_plan(total_heads, producer_tp, consumer_tp, consumer_rank)}
    mine |= {p for p in range(producer_tp) if p not in read_by_anyone and p % consumer_tp == consumer_rank}
    return sorted(mine)


def expected_notices(total_heads: int, producer_tp: int, consumer_tp: int, producer_rank: int) -> int:
    """How many consumer ranks tell producer_rank "done" for one transfer."""
    return sum(producer_rank in notify_ranks(total_heads, producer_tp, consumer_tp, c) for c in range(consumer_tp))
