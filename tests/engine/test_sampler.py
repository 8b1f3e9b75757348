from __future__ import annotations

import math

import pytest
import torch

from pdcluster.engine.sampler import Sampler, SamplingState
from pdcluster.sampling_params import SamplingParams

V = 32
PAD = 8  # LM-head padding columns past the vocabulary


def state(prompt: list[int] | None = None, output: list[int] | None = None, eos: tuple[int, ...] = (),
          **params: object) -> SamplingState:
    return SamplingState(SamplingParams(**params), list(prompt or [1, 2, 3]), list(output or []), eos)


def padded_logits(rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, V + PAD, generator=g) * 3
    logits[:, V:] = 1e4  # the padding would win every argmax if it were not excluded
    return logits


def test_greedy_fast_path_is_argmax_and_ignores_padding() -> None:
    logits = padded_logits(6)
    tokens, lps = Sampler(V)(logits, [state(temperature=0.0) for _ in range(6)])
    assert tokens == logits[:, :V].argmax(-1).tolist()
    assert lps == [None] * 6


def test_greedy_slow_path_matches_fast_path() -> None:
    logits = padded_logits(4, seed=1)
    states = [state(temperature=0.0, logprobs=2 if i % 2 else None) for i in range(4)]
    tokens, _ = Sampler(V)(logits, states)
    assert tokens == logits[:, :V].argmax(-1).tolist()


@pytest.mark.parametrize("c_argmax", ["1", "0"])
def test_greedy_rows_take_the_c_argmax_unless_switched_off(c_argmax: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy rows (both paths) go through kernels/argmax_cpu.py where it is built, torch.argmax
    with PDCLUSTER_CPU_ARGMAX=0: the same tokens either way (the padding never wins)."""
    from pdcluster.engine import sampler as sampler_mod
    from pdcluster.kernels import argmax_cpu

    calls = []

    def counted(x: torch.Tensor) -> torch.Tensor | None:
        calls.append(x.shape)
        return argmax_cpu.argmax_rows(x)

    monkeypatch.setattr(sampler_mod, "argmax_rows", counted)
    monkeypatch.setenv("PDCLUSTER_CPU_ARGMAX", c_argmax)
    logits = padded_logits(5, seed=2)
    logits[1, 3] = logits[1, 9] = 100.0  # a tie: the first index
    fast, _ = Sampler(V)(logits, [state(temperature=0.0) for _ in range(5)])
    slow, _ = Sampler(V)(logits, [state(temperature=0.0, logprobs=1) for _ in range(5)])
    assert fast == slow == logits[:, :V].argmax(-1).tolist() and fast[1] == 3
    assert len(calls) == (2 if c_argmax == "1" else 0)


def test_top_k_one_equals_greedy() -> None:
    logits = padded_logits(8, seed=2)
    sampler = Sampler(V, seed=0)
    tokens, _ = sampler(logits, [state(temperature=1.3, top_k=1) for _ in range(8)])
    assert tokens == logits[:, :V].argmax(-1).tolist()


def test_never_samples_padding_when_random() -> None:
    logits = padded_logits(64, seed=3)
    tokens, _ = Sampler(V, seed=0)(logits, [state(temperature=2.0) for _ in range(64)])
    assert max(tokens) < V


def test_seeded_reproducible_across_batches_positions_and_samplers() -> None:
    """A seeded request's token at position p depends on (seed, p, logits) only: not on the batch
    around it, its row, or the sampler instance (another process, e.g. prefill vs decode worker)."""
    row = padded_logits(1, seed=4)[0]
    positions = range(12)

    def run(sampler: Sampler, pos: int, others: int, where: int) -> int:
        states = [state(output=[0] * (pos + i), temperature=1.0, top_p=0.9, seed=None if i % 2 else 99 + i)
                  for i in range(others)]
        states.insert(where, state(output=[5] * pos, temperature=0.8, top_k=12, top_p=0.97, min_p=0.001,
                                   frequency_penalty=0.1, seed=1234))
        logits = padded_logits(len(states), seed=pos + others)
        logits[where] = row
        tokens, _ = sampler(logits, states)
        return tokens[where]

    alone = [run(Sampler(V, seed=1), p, 0, 0) for p in positions]
    in_batch = [run(Sampler(V, seed=2), p, 5, 3) for p in positions]
    other_sampler = [run(Sampler(V), p, 2, 2) for p in positions]
    assert alone == in_batch == other_sampler
    assert len(set(alone)) > 1  # positions draw different noise


def test_unseeded_engine_generator_is_deterministic_given_engine_seed() -> None:
    logits = padded_logits(16, seed=5)
    states = [state(temperature=1.0) for _ in range(16)]
    assert Sampler(V, seed=7)(logits, states)[0] == Sampler(V, seed=7)(logits, states)[0]


def test_random_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 4000
    logits = probs.log().expand(n, 4).contiguous()
    # Half unseeded (engine generator), half seeded with distinct seeds at position 0.
    states = [state(temperature=1.0, seed=i if i % 2 else None) for i in range(n)]
    tokens, _ = Sampler(4, seed=0)(logits, states)
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / n
    assert torch.allclose(freq, probs, atol=0.03), freq


@pytest.mark.parametrize(
    "params, allowed",
    [
        ({"top_p": 0.75}, {0, 1}),  # mass before token 2 is 0.8 >= 0.75
        ({"top_p": 0.85}, {0, 1, 2}),
        ({"min_p": 0.25}, {0, 1}),  # threshold 0.125
        ({"top_k": 2}, {0, 1}),
        ({"top_k": 3, "top_p": 0.5}, {0}),
        ({"min_p": 0.15, "top_p": 0.95}, {0, 1, 2}),
    ],
)
def test_truncation_never_picks_masked_tokens(params: dict, allowed: set[int]) -> None:
    probs = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.05])
    n = 2000
    logits = probs.log().expand(n, 5).contiguous()
    states = [state(temperature=1.0, seed=i, **params) for i in range(n)]
    tokens, _ = Sampler(5, seed=0)(logits, states)
    assert set(tokens) == allowed


def test_penalties_hand_checked() -> None:
    logits = torch.tensor([[2.0, -1.0, 1.5, 0.5, 0.0, 3.0]])
    st = state(prompt=[0, 1], output=[2, 2, 3], repetition_penalty=2.0, presence_penalty=0.5,
               frequency_penalty=0.25, temperature=0.0)
    x = logits.clone()
    Sampler(6)._apply_penalties(x, [st])
    # repetition (prompt + output): 2.0/2, -1.0*2, 1.5/2, 0.5/2; then output-only frequency/presence:
    # token 2 (count 2): 0.75 - 0.25*2 - 0.5; token 3 (count 1): 0.25 - 0.25 - 0.5.
    expected = torch.tensor([[1.0, -2.0, -0.25, -0.5, 0.0, 3.0]])
    assert torch.allclose(x, expected)


def test_penalties_change_greedy_choice_only_for_penalised_rows() -> None:
    logits = torch.tensor([[1.0, 0.9, 0.0], [1.0, 0.9, 0.0]])
    states = [state(output=[0], presence_penalty=0.5, temperature=0.0), state(output=[0], temperature=0.0)]
    tokens, _ = Sampler(3)(logits, states)
    assert tokens == [1, 0]


def test_min_tokens_blocks_eos_and_stop_tokens() -> None:
    eos, stop = 3, 4
    logits = torch.tensor([[0.0, 1.0, 0.5, 9.0, 8.0]]).repeat(3, 1)
    states = [
        state(output=[1], eos=(eos,), min_tokens=2, stop_token_ids=[stop], temperature=0.0),
        state(output=[1, 1], eos=(eos,), min_tokens=2, stop_token_ids=[stop], temperature=0.0),  # reached
        state(output=[1], eos=(eos,), min_tokens=2, stop_token_ids=[stop], temperature=1.0, seed=0),
    ]
    tokens, _ = Sampler(5)(logits, states)
    assert tokens[0] == 1 and tokens[1] == eos and tokens[2] not in (eos, stop)


def test_min_tokens_with_ignore_eos_leaves_eos_but_blocks_stop_tokens() -> None:
    logits = torch.tensor([[0.0, 1.0, 0.5, 9.0, 8.0]])
    st = state(output=[], eos=(3,), min_tokens=2, stop_token_ids=[4], ignore_eos=True, temperature=0.0)
    assert Sampler(5)(logits, [st])[0] == [3]
    logits[0, 3] = -9.0
    assert Sampler(5)(logits, [st])[0] == [1]


def test_logprobs_match_raw_log_softmax_with_ranks() -> None:
    logits = padded_logits(3, seed=6)
    states = [
        state(output=[7], temperature=0.7, top_k=5, repetition_penalty=1.5, logprobs=4, seed=3),
        state(temperature=0.0, logprobs=0),
        state(temperature=1.0),
    ]
    tokens, lps = Sampler(V)(logits, states)
    raw = torch.log_softmax(logits[:, :V], dim=-1)  # before penalties and temperature (vLLM v1)
    for i in (0, 1):
        lp = lps[i]
        assert lp is not None
        assert lp.sampled.token_id == tokens[i]
        assert math.isclose(lp.sampled.logprob, raw[i, tokens[i]].item(), rel_tol=1e-5)
        assert lp.sampled.rank == int((raw[i] > raw[i, tokens[i]]).sum()) + 1
    top = lps[0].top
    assert [t.rank for t in top] == [1, 2, 3, 4]
    order = raw[0].argsort(descending=True)[:4].tolist()
    assert [t.token_id for t in top] == order
    assert all(math.isclose(t.logprob, raw[0, t.token_id].item(), rel_tol=1e-5) for t in top)
    assert lps[1].top == [] and lps[1].sampled.rank == 1
    assert lps[2] is None


def test_bad_shapes_raise() -> None:
    with pytest.raises(ValueError):
        Sampler(V)(torch.zeros(2, V - 1), [state(), state()])
    with pytest.raises(ValueError):
        Sampler(V)(torch.zeros(3, V), [state()])
    assert Sampler(V)(torch.zeros(0, V), []) == ([], [])


def _reference_keep(x: torch.Tensor, k: int, p: float) -> torch.Tensor:
    """Straightforward top-k then top-p on one row over the whole vocabulary (ties kept)."""
    kth = x.sort(descending=True).values[k - 1]
    x = x.masked_fill(x < kth, float("-inf"))
    probs = x.softmax(-1)
    sorted_probs = probs.sort(descending=True).values
    cum = sorted_probs.cumsum(-1)
    last = int((cum < p).sum()) if p < 1.0 else len(cum) - 1  # minimal prefix reaching p
    cut = sorted_probs[min(last, len(cum) - 1)]
    return (probs >= cut) & (probs > 0)


def test_top_k_top_p_candidates_and_full_sort_agree_with_reference() -> None:
    """V above the candidate count: peaked rows take the partial top-k path, flat rows with top_p
    only (or a large top_k) fall back to a full sort; both must match the plain definition."""
    from pdcluster.engine.sampler import _NUM_CANDIDATES, _top_k_top_p_mask

    v = 3 * _NUM_CANDIDATES
    g = torch.Generator().manual_seed(0)
    ks = (0, 7, _NUM_CANDIDATES + 5)
    cases = [(scale, k, p) for scale in (0.05, 6.0) for k in ks for p in (1.0, 0.5, 0.97) if k or p < 1.0]
    x = torch.stack([torch.randn(v, generator=g) * scale for scale, _, _ in cases])
    top_k = torch.tensor([k or v for _, k, _ in cases])
    top_p = torch.tensor([p for _, _, p in cases])
    kept = _top_k_top_p_mask(x, top_k, top_p) > float("-inf")
    for i, (_, k, p) in enumerate(cases):
        assert torch.equal(kept[i], _reference_keep(x[i], k or v, p)), cases[i]
