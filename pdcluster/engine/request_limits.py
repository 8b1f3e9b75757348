"""Request limits the scheduler enforces: admission (length, cache size) and token-level stops.

Stop strings are text-level and live in output_processor.py; these need only token ids.
"""

from __future__ import annotations

from pdcluster.engine.kv_window import min_pool_blocks, step_blocks
from pdcluster.engine.request import Request, RequestStatus


def never_fits(num_tokens: int, block_size: int, num_blocks: int, sliding_window: int | None = None,
               num_computed: int = 0) -> str | None:
    """Why a step bringing a request to num_tokens (from num_computed) can never be cached (more
    blocks than the cache has), or None. With a sliding window (every layer slides and blocks
    behind it are freed) only the blocks the step can read count, not the whole length."""
    needed = step_blocks(num_computed, num_tokens - num_computed, block_size, sliding_window)
    if needed <= num_blocks:
        return None
    held = "" if sliding_window is None else f" within its window of {sliding_window}"
    return (f"request needs {needed} KV blocks for {num_tokens} tokens{held} but the cache holds only "
            f"{num_blocks} blocks of {block_size} tokens")


def admission_error(request: Request, max_model_len: int, block_size: int, num_blocks: int,
                    sliding_window: int | None = None) -> str | None:
    """Why a new request can never run, or None. With a sliding window a request of any length
    runs once the pool holds one decode step's window (the scheduler caps chunks to the pool)."""
    n = request.num_prompt_tokens
    if n == 0:
        return "prompt is empty"
    if n > max_model_len:
        return f"prompt is {n} tokens, more than max_model_len={max_model_len}"
    if sliding_window is None:
        return never_fits(n, block_size, num_blocks)
    longest = min(max_model_len, n + request.sampling_params.max_tokens)
    needed = min(min_pool_blocks(sliding_window, block_size), -(-longest // block_size))
    if needed <= num_blocks:
        return None
    return (f"request needs {needed} KV blocks for its window of {sliding_window} tokens but the cache "
            f"holds only {num_blocks} blocks of {block_size} tokens")


def check_stop(request: Request, max_model_len: int) -> RequestStatus | None:
    """Token-level stops after appending a token. A stop token wins over a length limit hit by
    the same token (the model did stop there); neither stop kind fires before min_tokens."""
    params = request.sampling_params
    last = request.output_token_ids[-1]
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and last in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if last in params.stop_token_ids:
            request.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= params.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def append_until_stop(request: Request, token_ids: list[int],
                      max_model_len: int) -> tuple[list[int], RequestStatus | None]:
    """Append sampled tokens up to the first stop; returns (tokens kept, finished status or None).
    Tokens sampled past a stop are dropped."""
    new: list[int] = []
    status = None
    for token_id in token_ids:
        request.append_output_token(token_id)
        new.append(token_id)
        status = check_stop(request, max_model_len)
        if status is not None:
            break
    return new, status


__all__ = ["admission_error", "append_until_stop", "check_stop", "never_fits"]
