"""Logprob entries from rows of logits: the sampler's (one row per sampled token) and the prompt's
(one row per prompt position, engine/prompt_logprobs.py) come out of the same function, so both
report a token's logprob, rank and top-n alternatives the same way.

    rows of raw logits (R, V) --log_softmax--> (R, V) --gather/rank/topk--> R x SampleLogprobs

rank = 1 + how many tokens are strictly more likely (vLLM's convention); the top-n are the n most
likely, most likely first, ranked 1..n.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdcluster.engine.outputs import Logprob, SampleLogprobs


def token_logprobs(raw: torch.Tensor, token_ids: torch.Tensor, nums: Sequence[int]) -> list[SampleLogprobs]:
    """raw: (R, V) float32 logits; token_ids: (R,) the token each row reports; nums: top-n per row."""
    log_probs = torch.log_softmax(raw, dim=-1)
    chosen = log_probs.gather(1, token_ids[:, None])  # (R, 1)
    ranks = (log_probs > chosen).sum(dim=-1) + 1
    num_top = max(nums, default=0)
    top_vals_l: list[list[float]] = [[] for _ in nums]
    top_ids_l: list[list[int]] = [[] for _ in nums]
    if num_top:
        top_vals, top_ids = log_probs.topk(num_top, dim=-1)  # (R, num_top), most likely first
        top_vals_l, top_ids_l = top_vals.tolist(), top_ids.tolist()
    out = []
    for r, (t, lp, rank, n) in enumerate(zip(token_ids.tolist(), chosen[:, 0].tolist(), ranks.tolist(), nums,
                                             strict=True)):
        pairs = zip(top_ids_l[r][:n], top_vals_l[r][:n], strict=True)
        top = [Logprob(i, v, k) for k, (i, v) in enumerate(pairs, start=1)]
        out.append(SampleLogprobs(sampled=Logprob(t, lp, rank), top=top))
    return out
