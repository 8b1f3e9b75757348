"""Prompt logprobs (SamplingParams.prompt_logprobs): the logprob, rank and top-n alternatives of
every prompt token after the first, from the hidden states the prefill computes anyway.

The hidden state at position p predicts token p + 1, so a prefill chunk covering positions
[c, c + q) scores prompt tokens c + 1 .. min(c + q, P - 1) (P = prompt length); the last prompt
position predicts the first output token, which the sampler handles. Rows go through the LM head
in slices (a 2k-token chunk at a 150k vocabulary would be a 1.2 GB float32 tensor at once).

Such a request never reads the prefix cache (scheduler: a cached position has no hidden state)
and is refused as a decode leg (its prompt is not computed there). After a preemption the prompt
is recomputed and the entries come again; Request.add_prompt_logprobs keeps each position once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pdcluster.engine.logprobs import token_logprobs
from pdcluster.engine.outputs import SampleLogprobs

ROWS_PER_SLICE = 256


def chunk_prompt_logprobs(reqs: Sequence[Any], query_lens: Sequence[int], hidden: torch.Tensor,
                          compute_logits: Any, vocab_size: int) -> dict[str, tuple[int, list[SampleLogprobs]]]:
    """reqs: the runner's CachedRequestStates of this step (num_computed_tokens not yet advanced),
    query_lens their scheduled tokens, hidden (T, H) in the same order. Returns request id ->
    (index of the first prompt token scored, one entry per scored token), for the requests that
    asked and scored any prompt token this step."""
    rows: list[int] = []
    targets: list[int] = []
    nums: list[int] = []
    spans: list[tuple[str, int, int]] = []  # (request id, first scored token, count)
    start = 0
    for r, q in zip(reqs, query_lens):
        n = r.prompt_logprobs
        c = r.num_computed_tokens
        last = min(c + q, r.num_prompt_tokens - 1)  # the last prompt token this chunk scores
        if n is not None and last > c:
            rows.extend(range(start, start + last - c))
            targets.extend(r.token_ids[c + 1: last + 1])
            nums.extend([n] * (last - c))
            spans.append((r.request_id, c + 1, last - c))
        start += q
    if not rows:
        return {}
    entries: list[SampleLogprobs] = []
    device = hidden.device
    for i in range(0, len(rows), ROWS_PER_SLICE):
        idx = torch.tensor(rows[i:i + ROWS_PER_SLICE], device=device)
        raw = compute_logits(hidden[idx])[:, :vocab_size].float()
        ids = torch.tensor(targets[i:i + ROWS_PER_SLICE], device=device)
        entries.extend(token_logprobs(raw, ids, nums[i:i + ROWS_PER_SLICE]))
    out: dict[str, tuple[int, list[SampleLogprobs]]] = {}
    k = 0
    for request_id, first, count in spans:
        out[request_id] = (first, entries[k:k + count])
        k += count
    return out
