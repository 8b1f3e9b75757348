"""vLLM's allowed_token_ids and bad_words: the pure matching (milliseconds), the sampler's masks on
given logits, and the offline engine on a tiny byte-level model (one token per byte, so a word's
tokens are its bytes): every output token allowed, no bad word in any output, a ban lifted rather
than sampling from nothing, and the requests that could only sample from nothing refused by name."""

from __future__ import annotations

import pytest
import torch
from bytelevel_tiny import make_bytelevel_checkpoint

from pdcluster import LLM, SamplingParams
from pdcluster.bad_words import banned_ids, tokenize_bad_words
from pdcluster.engine.sampler import Sampler, SamplingState
from pdcluster.proto_convert import sampling_params_from_proto, sampling_params_to_proto


def contains(seq: list[int], sub: tuple[int, ...]) -> bool:
    return any(tuple(seq[i:i + len(sub)]) == sub for i in range(len(seq) - len(sub) + 1))


# -- pure -----------------------------------------------------------------------------------------
def test_banned_ids_match_the_output_tail() -> None:
    seqs = ((7,), (1, 2, 3), (2, 9))
    assert banned_ids(seqs, []) == [7]
    assert sorted(banned_ids(seqs, [5, 1, 2])) == [3, 7, 9]
    assert banned_ids(seqs, [1, 2, 4]) == [7]
    assert sorted(banned_ids(seqs, [2])) == [7, 9]
    assert set(banned_ids(((4, 5), (4, 6), (1, 4, 5)), [1, 4])) == {5, 6}  # one prefix, two words


def test_words_are_spelled_as_written_and_after_a_space() -> None:
    encode = {"ab": [1, 2], " ab": [3, 1, 2], "c": [4], " c": [3, 4]}.__getitem__
    assert tokenize_bad_words(["ab", "  c", "ab"], encode) == ((1, 2), (3, 1, 2), (4,), (3, 4))


def test_params_bound_and_carry_the_fields() -> None:
    p = SamplingParams(allowed_token_ids=[9, 3, 9], bad_words=["x y"])
    assert p.allowed_token_ids == (3, 9)
    back = sampling_params_from_proto(sampling_params_to_proto(p))
    assert back.allowed_token_ids == (3, 9) and back.bad_words == ("x y",)
    for bad, field in [(dict(allowed_token_ids=list(range(5000))), "allowed_token_ids has 5000 ids; at most 4096"),
                       (dict(allowed_token_ids=[-1]), "allowed_token_ids"),
                       (dict(bad_words=[" "]), "bad_words must be non-empty"),
                       (dict(bad_words=["a"] * 65), "bad_words has 65 words; at most 64"),
                       (dict(bad_words=["a" * 257]), "at most 256"),
                       (dict(allowed_token_ids=[1], structured_outputs={"regex": "a"}), "allowed_token_ids cannot"),
                       (dict(bad_words=["a"], structured_outputs={"choice": ["a"]}), "bad_words cannot")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**bad)


# -- the sampler on given logits ---------------------------------------------------------------------
def _state(output: list[int], **params: object) -> SamplingState:
    return SamplingState(SamplingParams(**params), [1, 2], output, (0,))


def test_sampler_masks_to_the_allowed_ids_and_bans_bad_words() -> None:
    logits = torch.arange(16, dtype=torch.float32).repeat(3, 1)  # the highest id wins unmasked
    states = [_state([], temperature=0.0, allowed_token_ids=[2, 5]),
              _state([4], temperature=0.0, bad_words=["z"], bad_words_token_ids=[[15], [4, 14]]),
              _state([], temperature=1.0, seed=3, allowed_token_ids=[7])]
    tokens, _ = Sampler(16)(logits, states)
    assert tokens == [5, 13, 7]


def test_a_ban_that_would_leave_nothing_is_lifted() -> None:
    """allowed {6}, and the bad word "6 6" after a 6: the only allowed token is banned, so the ban
    is lifted for that row (never an argmax over -inf that picks token 0)."""
    logits = torch.zeros(2, 16)
    states = [_state([6], temperature=0.0, allowed_token_ids=[6], bad_words=["w"], bad_words_token_ids=[[6, 6]]),
              _state([6], temperature=0.5, seed=1, allowed_token_ids=[6], bad_words=["w"],
                     bad_words_token_ids=[[6, 6]])]
    assert Sampler(16)(logits, states)[0] == [6, 6]


# -- the offline engine -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    return LLM(make_bytelevel_checkpoint(tmp_path_factory.mktemp("bl") / "m"), max_model_len=256)


def _ids(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_token_is_allowed(llm, temperature):
    allowed = set(_ids(llm, "abc 123"))
    for seed in range(3):
        out = llm.generate(["hello"], SamplingParams(temperature=temperature, seed=seed, max_tokens=24,
                                                     allowed_token_ids=sorted(allowed)))[0].outputs[0]
        assert len(out.token_ids) == 24 and set(out.token_ids) <= allowed, out.text


def test_bad_words_never_appear_and_the_rest_is_unchanged(llm):
    letters = sorted(set(_ids(llm, "abcdefghijklmnopqrstuvwxyz")))  # a random model writes these too
    plain = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, allowed_token_ids=letters)
    want = list(llm.generate(["hello"], plain)[0].outputs[0].token_ids)
    word = llm.tokenizer.decode(want[4:7])  # three letters the model writes when free
    seqs = tokenize_bad_words([word], lambda t: _ids(llm, t))
    assert seqs[0] == tuple(want[4:7])
    out = list(llm.generate(["hello"], plain.replace(bad_words=[word]))[0].outputs[0].token_ids)
    assert len(out) == 32 and not any(contains(out, s) for s in seqs)
    first = next(i for i in range(5) if want[i:i + 3] == want[4:7])
    # Greedy as before until the ban bites, at the word's last byte.
    assert out[:first + 2] == want[:first + 2] and out[first + 2] != want[first + 2]


def test_sampled_outputs_avoid_a_one_byte_word(llm):
    e = _ids(llm, "e")[0]
    for seed in range(3):
        out = llm.generate(["hello"], SamplingParams(temperature=1.0, seed=seed, max_tokens=40, ignore_eos=True,
                                                     bad_words=["e"]))[0].outputs[0]
        assert e not in out.token_ids and " e" not in out.text


def test_allowed_with_a_bad_word_over_it_goes_on(llm):
    a = _ids(llm, "a")[0]
    out = llm.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                 allowed_token_ids=[a], bad_words=["aa"]))[0].outputs[0]
    assert list(out.token_ids) == [a] * 6


def test_requests_that_could_only_sample_from_nothing_are_refused(llm):
    a, eos = _ids(llm, "a")[0], 2
    with pytest.raises(ValueError, match="allowed_token_ids: every allowed token is a bad_words token"):
        llm.generate(["hello"], SamplingParams(allowed_token_ids=[a], bad_words=["a"]))
    with pytest.raises(ValueError, match="allowed_token_ids: every allowed token is a stop token"):
        llm.generate(["hello"], SamplingParams(allowed_token_ids=[eos], min_tokens=2))
    with pytest.raises(ValueError, match=r"allowed_token_ids: token id 384 is outside the vocabulary \[0, 384\)"):
        llm.generate(["hello"], SamplingParams(allowed_token_ids=[384]))
    # The engine still serves after every refusal.
    assert llm.generate(["hello"], SamplingParams(max_tokens=2, ignore_eos=True))[0].outputs[0].token_ids
