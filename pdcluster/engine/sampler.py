"""Sampler: one next token per request from a batch of logits.

Pipeline per step (each stage runs only on the rows that use it, vectorised over those rows):

    raw logits[:, :vocab_size]                -> logprobs (log_softmax of the raw logits, vLLM v1 default)
      -> structured-output grammar masks (one batched bitmask, engine/structured_output.py)
      -> allowed_token_ids (every other logit -inf)
      -> logit_bias
      -> penalties (repetition, presence, frequency)
      -> min_tokens mask (eos / stop_token_ids forbidden until min_tokens outputs exist)
      -> a row these masks leave with no token fails its request (SamplingState.fault)
      -> bad_words bans (lifted for a row they would leave with no token at all)
      -> greedy rows: argmax
      -> random rows: / temperature -> min_p -> top_k -> top_p -> softmax -> inverse CDF

Each random row needs one uniform u: the token is the first whose cumulative probability exceeds
u. For a seeded request u is a stable hash of (seed, output position) only, so its tokens do not
depend on the batch it runs in, the process, the device, or which worker sampled the previous
token (disaggregated prefill/decode reproduces the aggregated run). Unseeded rows draw u from one
engine-level generator. (One uniform per row instead of vocabulary-sized Gumbel/exponential noise:
the same distribution for a fraction of the random numbers, and no per-row generator launches.)
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch

from pdcluster.bad_words import banned_ids
from pdcluster.engine.logprobs import token_logprobs
from pdcluster.engine.outputs import RequestFault, SampleLogprobs
from pdcluster.env_flags import env_enabled
from pdcluster.kernels.argmax_cpu import argmax_rows
from pdcluster.sampling_params import SamplingParams

ARGMAX_ENV = "PDCLUSTER_CPU_ARGMAX"  # "0": torch.argmax for greedy rows (the same indices, slower)

# Temperatures below this are treated as greedy: dividing logits by them gains nothing over argmax
# and risks overflow to inf (vLLM uses the same cut-off).
_GREEDY_TEMPERATURE = 1e-5
# top_k/top_p look at this many most likely tokens first; a whole-vocabulary sort only when a
# row's kept set may reach past them (top_k larger, or top_p not reached within them).
_NUM_CANDIDATES = 1024


@dataclass
class SamplingState:
    """What the sampler needs to know about one request for one step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far (penalties, min_tokens, seeded position)
    eos_token_ids: tuple[int, ...]
    # structured_output.GrammarState of a constrained request; the sampler advances it with the
    # token it picks, unless this row checks drafts (below).
    grammar: Any = None
    # A row of a step that checks drafts (speculative decoding): how many of the request's drafts
    # come before this row's token (the last ones of output_token_ids). Its grammar mask is the
    # matcher's state after them, and the runner, not the sampler, advances the matcher with the
    # tokens that are kept. None: an ordinary row.
    drafts_before: int | None = None
    # Set by the sampler when the request's masks left this row no token to sample: the token
    # it returns for the row means nothing, and the request ends with this error.
    fault: RequestFault | None = None

    @property
    def is_greedy(self) -> bool:
        return self.params.temperature < _GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        p = self.params
        return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0

    def min_tokens_banned_ids(self) -> tuple[int, ...]:
        """Token ids to forbid this step so that the request cannot stop before min_tokens.

        stop_token_ids are always banned. eos is banned only without ignore_eos: with ignore_eos,
        eos does not end the request, so it is an ordinary token and masking it would distort the
        distribution for nothing (same as vLLM's all_stop_token_ids).
        """
        p = self.params
        if len(self.output_token_ids) >= p.min_tokens:
            return ()
        if p.ignore_eos:
            return p.stop_token_ids
        return p.stop_token_ids + self.eos_token_ids

    def bad_words_banned_ids(self) -> list[int]:
        return banned_ids(self.params.bad_words_token_ids, self.output_token_ids) if self.params.bad_words else []


def seeded_uniform_bits(seed: int, position: int) -> int:
    """32 random bits for (request seed, output position), the same on every process and platform
    (a cryptographic hash, never Python's salted hash)."""
    digest = hashlib.blake2b(struct.pack("<QQ", seed, position), digest_size=4).digest()
    return int.from_bytes(digest, "little")


class Sampler:
    def __init__(
        self, vocab_size: int, device: torch.device | str = "cpu", *, seed: int | None = None
    ) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._c_argmax = env_enabled(ARGMAX_ENV)
        # Engine-level generator for unseeded requests; seeded from the OS unless a seed is given
        # (tests, or tensor-parallel ranks that must draw the same noise).
        self._generator = torch.Generator(device=self.device)
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, states: list[SamplingState]
    ) -> tuple[list[int], list[SampleLogprobs | None]]:
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits must be (num_reqs={len(states)}, V), got {tuple(logits.shape)}")
        if logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits have {logits.shape[1]} columns < vocab_size={self.vocab_size}")
        if not states:
            return [], []
        # Columns past vocab_size are padding of the LM head: never sampled, never in logprobs.
        logits = logits[:, : self.vocab_size].to(self.device)
        banned = [s.min_tokens_banned_ids() for s in states]
        bad = [s.bad_words_banned_ids() for s in states]
        constrained = any(s.grammar is not None for s in states)
        biased = any(s.params.logit_bias or s.params.allowed_token_ids for s in states)
        plain = all(s.is_greedy and not s.has_penalties and s.params.logprobs is None for s in states)
        if plain and not any(banned) and not any(bad) and not constrained and not biased:
            return self._argmax(logits).tolist(), [None] * len(states)

        raw = logits.float()
        # Masks, biases, penalties and bans edit in place: copy only then (raw stays intact for
        # logprobs). Every (B, V) copy or gather costs as much as a softmax, so stages skip them
        # where they can.
        edits = any(banned) or any(bad) or any(s.has_penalties for s in states) or constrained or biased
        x = raw.clone() if edits else raw
        if edits:
            grammar_rows: list[int] = []
            if constrained:
                from pdcluster.engine.structured_output import apply_grammar_masks  # lazy: imports xgrammar

                grammar_rows = apply_grammar_masks(x, [s.grammar for s in states],
                                                   [s.output_token_ids[len(s.output_token_ids) - (s.drafts_before or 0):]
                                                    for s in states])
            self._apply_allowed(x, states)
            self._apply_logit_bias(x, states)
            self._apply_penalties(x, states)
            self._apply_bans(x, banned)
            self._fail_empty_rows(x, states, grammar_rows, banned)
            self._apply_bad_words(x, bad)
        greedy = [i for i, s in enumerate(states) if s.is_greedy]
        random = [i for i, s in enumerate(states) if not s.is_greedy]
        if not random:
            token_ids = self._argmax(x)
        elif not greedy:
            token_ids = self._sample_random(x, states)
        else:
            token_ids = torch.empty(len(states), dtype=torch.long, device=self.device)
            token_ids[self._index(greedy)] = x[self._index(greedy)].argmax(dim=-1)
            rows = self._index(random)
            token_ids[rows] = self._sample_random(x[rows], [states[i] for i in random])
        chosen = token_ids.tolist()
        for s, t in zip(states, chosen):
            if s.grammar is not None and s.drafts_before is None and s.fault is None:
                s.grammar.advance([t])
        return chosen, self._logprobs(raw, token_ids, states)

    # -- stages -------------------------------------------------------------------------------
    def _argmax(self, x: torch.Tensor) -> torch.Tensor:
        """x.argmax(dim=-1), through the C kernel where it applies (float32 CPU logits: a fraction
        of torch's time at vocabulary sizes, kernels/argmax_cpu.py), the same indices either way."""
        picked = argmax_rows(x) if self._c_argmax else None
        return x.argmax(dim=-1) if picked is None else picked

    def _index(self, rows: list[int]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def _on_rows(
        self, x: torch.Tensor, rows: list[int], fn: Callable[..., torch.Tensor], *args: torch.Tensor
    ) -> torch.Tensor:
        """fn(x[rows], *args) written back into x; no gather/scatter when rows is every row."""
        if len(rows) == x.shape[0]:
            return fn(x, *args)
        idx = self._index(rows)
        x[idx] = fn(x[idx], *args)
        return x

    def _pairs(self, ids_per_row: list[tuple[int, ...]] | list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, cols) index tensors of every (row, id) pair: one gather or scatter for the
        whole batch, whatever its size."""
        pairs = [(i, t) for i, ids in enumerate(ids_per_row) for t in ids if t < self.vocab_size]
        rows, cols = zip(*pairs, strict=True) if pairs else ((), ())
        return self._index(list(rows)), self._index(list(cols))

    def _apply_allowed(self, x: torch.Tensor, states: list[SamplingState]) -> None:
        allowed = [s.params.allowed_token_ids for s in states]
        if not any(allowed):
            return
        # Rows share few distinct sets: each set's index tensor is built once, not every step.
        per_row = [self._id_tensor(ids) for ids in allowed if ids]
        masked = self._index([i for i, ids in enumerate(allowed) if ids])
        rows = torch.repeat_interleave(masked, self._index([len(t) for t in per_row]))
        cols = torch.cat(per_row)
        kept = x[rows, cols]
        x.index_fill_(0, masked, float("-inf"))
        x[rows, cols] = kept

    @functools.lru_cache(maxsize=256)  # noqa: B019 - one Sampler per runner, for the process' life
    def _id_tensor(self, ids: tuple[int, ...]) -> torch.Tensor:
        return self._index([t for t in ids if t < self.vocab_size])

    def _fail_empty_rows(self, x: torch.Tensor, states: list[SamplingState], grammar_rows: list[int],
                         banned: list[tuple[int, ...]]) -> None:
        """A row its masks leave with no token (every logit -inf) has nothing to sample: a grammar
        this vocabulary can begin but not continue (a word-level vocabulary's "t1" of "t10"), or
        any combination admission's static checks did not catch (they refuse allowed_token_ids or
        min_tokens beside a grammar, and allowed_token_ids of only stop tokens under min_tokens).
        Its state gets a RequestFault naming the fields, so the request ends with an error instead
        of going on with a token they forbid (an argmax of -inf picks token 0). The row gets one
        finite logit so that sampling the rest of the batch goes on as usual. bad_words never
        empties a row: it lifts its own bans first (below)."""
        grammar = set(grammar_rows)
        masked = [i for i, s in enumerate(states) if i in grammar or s.params.allowed_token_ids or banned[i]]
        if not masked:
            return
        peaks = (x if len(masked) == len(states) else x[self._index(masked)]).amax(dim=-1)
        for j in torch.isneginf(peaks).nonzero().flatten().tolist():
            i = masked[j]
            s = states[i]
            fields = [name for name, on in (("structured_outputs", i in grammar),
                                            ("allowed_token_ids", bool(s.params.allowed_token_ids)),
                                            ("min_tokens", bool(banned[i]))) if on]
            after = len(s.output_token_ids)
            if fields == ["structured_outputs"]:
                message = (f"structured_outputs: the grammar allows no token of this model's vocabulary "
                           f"after {after} output tokens")
            else:
                message = f"{' and '.join(fields)} together leave no token to sample after {after} output tokens"
            s.fault = RequestFault(fields[0], message)
            x[i, 0] = 0.0

    def _apply_bad_words(self, x: torch.Tensor, bad: list[list[int]]) -> None:
        """A bad word's ban is lifted for a row it would leave with no token at all (every allowed
        token is the end of a matched bad word): the request goes on rather than sampling from
        nothing. The static cases are refused when the request arrives (LLMEngine)."""
        if not any(bad):
            return
        rows, cols = self._pairs(bad)
        kept = x[rows, cols]
        x[rows, cols] = float("-inf")
        banned_rows = self._index([i for i, ids in enumerate(bad) if ids])
        dead = banned_rows[torch.isneginf(x[banned_rows].amax(dim=-1))]
        if dead.numel():  # rare: put those rows' logits back
            lift = torch.isin(rows, dead)
            x[rows[lift], cols[lift]] = kept[lift]

    def _apply_logit_bias(self, x: torch.Tensor, states: list[SamplingState]) -> None:
        biased = [(i, self._bias_tensors(s.params.logit_bias)) for i, s in enumerate(states) if s.params.logit_bias]
        if not biased:
            return
        rows = torch.repeat_interleave(self._index([i for i, _ in biased]),
                                       self._index([len(cols) for _, (cols, _) in biased]))
        cols = torch.cat([cols for _, (cols, _) in biased])
        bias = torch.cat([b for _, (_, b) in biased]).to(x.dtype)
        x.index_put_((rows, cols), bias, accumulate=True)

    @functools.lru_cache(maxsize=256)  # noqa: B019 - as _id_tensor
    def _bias_tensors(self, pairs: tuple[tuple[int, float], ...]) -> tuple[torch.Tensor, torch.Tensor]:
        kept = [(t, b) for t, b in pairs if t < self.vocab_size]
        return (self._index([t for t, _ in kept]),
                torch.tensor([b for _, b in kept], dtype=torch.float32, device=self.device))

    def _apply_penalties(self, x: torch.Tensor, states: list[SamplingState]) -> None:
        rows = [i for i, s in enumerate(states) if s.has_penalties]
        if not rows:
            return
        sub = [states[i] for i in rows]
        idx = self._index(rows)
        scores = x[idx]  # (R, V)
        out_counts = self._token_counts([s.output_token_ids for s in sub])
        rep = torch.tensor([s.params.repetition_penalty for s in sub], device=self.device)[:, None]
        if any(s.params.repetition_penalty != 1.0 for s in sub):
            # HF semantics: a token seen in prompt or output has its logit divided by the penalty
            # when positive and multiplied when negative (both push it towards "less likely").
            seen = out_counts > 0
            seen |= self._token_counts(
                [s.prompt_token_ids if s.params.repetition_penalty != 1.0 else [] for s in sub]
            ) > 0
            scores = torch.where(seen, torch.where(scores > 0, scores / rep, scores * rep), scores)
        # OpenAI semantics over generated tokens only: subtract freq * count + presence * [count > 0].
        freq = torch.tensor([s.params.frequency_penalty for s in sub], device=self.device)[:, None]
        pres = torch.tensor([s.params.presence_penalty for s in sub], device=self.device)[:, None]
        scores = scores - freq * out_counts - pres * (out_counts > 0).float()
        x[idx] = scores

    def _token_counts(self, seqs: list[list[int]]) -> torch.Tensor:
        """(len(seqs), V) float counts of each token id per sequence, built with one scatter."""
        v = self.vocab_size
        counts = torch.zeros(len(seqs), v + 1, device=self.device)  # column v collects invalid ids
        lengths = torch.tensor([len(s) for s in seqs], device=self.device)
        if int(lengths.sum()) == 0:
            return counts[:, :v]
        flat = torch.tensor(list(chain.from_iterable(seqs)), dtype=torch.long, device=self.device)
        flat = torch.where((flat < 0) | (flat >= v), v, flat)
        row = torch.repeat_interleave(torch.arange(len(seqs), device=self.device), lengths)
        counts.index_put_((row, flat), torch.ones_like(flat, dtype=counts.dtype), accumulate=True)
        return counts[:, :v]

    def _apply_bans(self, x: torch.Tensor, banned: list[tuple[int, ...]]) -> None:
        pairs = [(i, t) for i, ids in enumerate(banned) for t in ids if 0 <= t < self.vocab_size]
        if pairs:
            rows, cols = zip(*pairs, strict=True)
            x[self._index(list(rows)), self._index(list(cols))] = float("-inf")

    def _sample_random(self, x: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """One token per row of x (R, V), all rows random; x itself is not modified."""
        temps = torch.tensor([s.params.temperature for s in states], device=self.device)
        scores = x / temps[:, None]  # new tensor: x may be the caller's raw logits
        min_p_rows = [j for j, s in enumerate(states) if s.params.min_p > 0.0]
        if min_p_rows:
            min_p = torch.tensor([states[r].params.min_p for r in min_p_rows], device=self.device)
            scores = self._on_rows(scores, min_p_rows, _min_p_mask, min_p)
        trunc_rows = [j for j, s in enumerate(states) if s.params.top_k > 0 or s.params.top_p < 1.0]
        if trunc_rows:
            v = self.vocab_size
            k = [min(states[r].params.top_k or v, v) for r in trunc_rows]
            top_k = torch.tensor(k, device=self.device)
            top_p = torch.tensor([states[r].params.top_p for r in trunc_rows], device=self.device)
            scores = self._on_rows(scores, trunc_rows, _top_k_top_p_mask, top_k, top_p)
        # Inverse CDF: the first token whose cumulative probability exceeds u * total. Masked tokens
        # have probability exactly 0 so the CDF does not rise at them and they are never picked.
        # float64: a float32 running sum over ~150k entries drifts by more than small probabilities.
        cdf = scores.softmax(dim=-1).cumsum(dim=-1, dtype=torch.float64)  # (R, V)
        u = self._uniforms(states) * cdf[:, -1:]  # (R, 1), strictly below the total
        return torch.searchsorted(cdf, u, right=True)[:, 0].clamp_(max=self.vocab_size - 1)

    def _uniforms(self, states: list[SamplingState]) -> torch.Tensor:
        """(R, 1) float64 on the grid k / 2**32 (so u * total < total). A seeded row's value is a
        hash of (seed, output position): the same on every device, process and batch."""
        u = torch.empty(len(states), 1, dtype=torch.float64, device=self.device)
        unseeded = [j for j, s in enumerate(states) if s.params.seed is None]
        if unseeded:
            draws = torch.randint(0, 2**32, (len(unseeded), 1), generator=self._generator, device=self.device)
            u[self._index(unseeded)] = draws.double() * 2.0**-32
        seeded = [j for j, s in enumerate(states) if s.params.seed is not None]
        if seeded:
            values = [seeded_uniform_bits(states[j].params.seed, len(states[j].output_token_ids)) * 2.0**-32
                      for j in seeded]
            u[self._index(seeded)] = torch.tensor(values, dtype=torch.float64, device=self.device)[:, None]
        return u

    def _logprobs(
        self, raw: torch.Tensor, token_ids: torch.Tensor, states: list[SamplingState]
    ) -> list[SampleLogprobs | None]:
        out: list[SampleLogprobs | None] = [None] * len(states)
        rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
        if not rows:
            return out
        idx = self._index(rows)
        entries = token_logprobs(raw[idx], token_ids[idx], [states[i].params.logprobs or 0 for i in rows])
        for i, entry in zip(rows, entries):
            out[i] = entry
        return out


def _min_p_mask(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the most likely token's."""
    probs = x.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return x.masked_fill(probs < threshold, float("-inf"))


def _top_k_top_p_mask(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the top_k most likely tokens, then the smallest most-likely set of the survivors whose
    probability reaches top_p. top_k = V and top_p = 1 disable a row's filter.

    Both filters become a per-row value threshold (ties with the boundary value are kept), so the
    kept set does not depend on how ties are ordered. Thresholds come from the row's largest
    _NUM_CANDIDATES values when its kept set provably lies among them (top_k <= that number, or
    those values already hold top_p of the mass): a partial top-k instead of sorting the whole
    vocabulary. A row's path depends only on that row, never on the batch.
    """
    v = x.shape[-1]
    num = min(_NUM_CANDIDATES, v)
    cand = x.topk(num, dim=-1).values  # (R, num), descending
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    covered = (top_k <= num) | ((top_k == v) & ((cand - lse).exp().sum(dim=-1) >= top_p))
    threshold = torch.empty_like(x[:, :1])  # (R, 1)
    if bool(covered.any()):
        c = covered
        threshold[c] = _threshold(cand[c], top_k[c], top_p[c], lse[c], v)
    if not bool(covered.all()):
        r = ~covered
        threshold[r] = _threshold(x[r].sort(dim=-1, descending=True).values, top_k[r], top_p[r], lse[r], v)
    return x.masked_fill(x < threshold, float("-inf"))


def _threshold(vals: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, lse: torch.Tensor,
               vocab_size: int) -> torch.Tensor:
    """(R, 1) smallest kept value, from each row's largest values sorted descending (R, C): C >= top_k
    for rows whose top_k cuts, C covering top_p of the mass for the others. lse: (R, 1) whole-row
    logsumexp."""
    kth = vals.gather(1, (top_k.clamp(max=vals.shape[1]) - 1)[:, None])  # (R, 1)
    vals = vals.masked_fill(vals < kth, float("-inf"))
    # top_p applies to the top_k survivors renormalised (vLLM); without top_k, to the whole row,
    # whose mass the candidates alone would undercount.
    norm = torch.where((top_k < vocab_size)[:, None], torch.logsumexp(vals, dim=-1, keepdim=True), lse)
    probs = (vals - norm).exp()
    mass_before = probs.cumsum(dim=-1) - probs
    # Rows with top_p = 1 keep everything: float rounding may push mass_before to 1.0 in the tail.
    drop = (mass_before >= top_p[:, None]) & (top_p < 1.0)[:, None]
    drop[:, 0] = False  # the most likely token always survives
    cut = vals.masked_fill(drop, float("inf")).amin(dim=-1, keepdim=True)
    return torch.maximum(kth, cut)
