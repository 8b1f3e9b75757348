"""Block arithmetic of a sliding window (pure: the KV manager, the scheduler, admission and the
P2P connector must agree on it, so it lives in one place).

The token at position p reads keys (p - w, p]. Once a request has computed c tokens, no later
token reads a position below c - w + 1, so the blocks wholly before it hold nothing anyone reads:
the KV manager frees them (placeholders), a hand-off need not send them. A step that computes n
tokens after c therefore needs only the blocks from `first_needed_block(c)` to the end of c + n:

    c = 14, n = 1, w = 6, bs = 4:   keys >= 9 are read   ->  blocks 2 and 3 (2 blocks, not 4)

The most one decode step can need, over every c, is `min_pool_blocks(w, bs)` = ceil((w-1)/bs)+1
(the window straddling one more block boundary than it spans); a chunk of n tokens needs about
n/bs more. So a pool of min_pool_blocks can serve a windowed request of any length, one token at
a time, with `max_step_tokens` capping its chunks to what the pool holds.
"""

from __future__ import annotations


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def first_needed_block(num_computed: int, window: int, block_size: int) -> int:
    """The first block a token computed after num_computed tokens can still read."""
    return max(0, num_computed - window + 1) // block_size


def step_blocks(num_computed: int, num_new: int, block_size: int, window: int | None) -> int:
    """Blocks a request holds after a step computing num_new tokens after num_computed (all of
    them without a window)."""
    total = _cdiv(num_computed + num_new, block_size)
    return total if window is None else total - first_needed_block(num_computed, window, block_size)


def min_pool_blocks(window: int, block_size: int) -> int:
    """The most blocks a one-token step of a windowed request needs, over every position."""
    return _cdiv(window - 1, block_size) + 1


def max_step_tokens(num_computed: int, window: int, block_size: int, num_blocks: int) -> int:
    """The most tokens one step after num_computed may compute with num_blocks blocks in all
    (>= 1 whenever num_blocks >= min_pool_blocks)."""
    return (first_needed_block(num_computed, window, block_size) + num_blocks) * block_size - num_computed


__all__ = ["first_needed_block", "max_step_tokens", "min_pool_blocks", "step_blocks"]
