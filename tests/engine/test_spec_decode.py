"""Speculative decoding with n-gram drafts (vLLM's --speculative-config, method "ngram").

The proposer and the config are pure (milliseconds). Through the engine, outputs never change:
greedy tokens equal transformers' and the plain engine's, seeded sampling and logprobs equal the
plain engine's, under preemption and in mixed batches; the KV of rejected drafts is never
published to the prefix cache; and drafts are accepted (the counters say so)."""

from __future__ import annotations

import pathlib

import pytest
import torch

from pdcluster import LLM, SamplingParams
from pdcluster.config import SpeculativeConfig
from pdcluster.engine.ngram_proposer import num_accepted, propose_ngram

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
ENGINE = {"max_model_len": 256, "block_size": 16}
# Loops and repeated phrases: the drafts find something to propose.
PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7], [20, 21, 22, 23, 24],
           list(range(30, 70)) + list(range(30, 40))]


# == the proposer ====================================================================================
def test_propose_ngram_longest_latest_match():
    #        0  1  2  3  4  5  6  7  8
    tokens = [1, 2, 3, 9, 1, 2, 3, 8, 2, 3]
    # Suffix [2, 3] occurred at 1 and 5: the latest (5) is followed by 8, 2, 3.
    assert propose_ngram(tokens, 1, 2, 3) == [8, 2, 3]
    # Suffix of 3 ([8, 2, 3]) never occurred: the 2-gram answers.
    assert propose_ngram(tokens, 1, 3, 2) == [8, 2]
    assert propose_ngram(tokens, 3, 3, 2) == []
    # The longest n wins over a later shorter match: [1, 2, 3] at 0 and 4; suffix 3-gram [1, 2, 3]
    # -> the latest earlier occurrence (4) is followed by 8.
    assert propose_ngram([1, 2, 3, 7, 1, 2, 3, 8, 1, 2, 3], 1, 3, 1) == [8]
    # Near the end the copy overlaps itself (LZ77): a loop continues for all k drafts.
    assert propose_ngram([4, 5, 4], 1, 1, 5) == [5, 4, 5, 4, 5]
    assert propose_ngram([9, 1, 2, 3, 1, 2, 3], 2, 3, 7) == [1, 2, 3, 1, 2, 3, 1]
    assert propose_ngram([4], 1, 1, 5) == [] and propose_ngram([], 1, 2, 3) == []
    assert propose_ngram([4, 4], 1, 1, 0) == []


def test_propose_ngram_ignores_matches_across_token_boundaries():
    # 256 packs as 00 01 00 00, then 0 as 00 00 00 00: bytes 1..4 spell token 1 (01 00 00 00),
    # a match that starts inside a token. It must not count.
    assert propose_ngram([256, 0, 7, 1], 1, 1, 2) == []
    assert propose_ngram([256, 0, 1, 7, 1], 1, 1, 2) == [7, 1]
    big = 32_000 * 7
    assert propose_ngram([big, 3, big + 1, big, 3], 2, 2, 1) == [big + 1]


def test_num_accepted():
    assert num_accepted([4, 5, 6], [4, 5, 7, 9]) == 2
    assert num_accepted([4, 5], [4, 5, 1]) == 2
    assert num_accepted([4], [3, 2]) == 0
    assert num_accepted([], [3]) == 0


# == the config ======================================================================================
def test_speculative_config_parse():
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("") is None
    cfg = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}')
    # One bound given sets the other (vLLM); neither: 2..4.
    assert cfg == SpeculativeConfig("ngram", 3, 5, 5)
    assert SpeculativeConfig.parse({"disable_by_batch_size": 4}).disable_by_batch_size == 4
    assert SpeculativeConfig.parse({"prompt_lookup_min": 1}) == SpeculativeConfig("ngram", 4, 1, 1)
    assert SpeculativeConfig.parse({}) is None and SpeculativeConfig.parse({"method": "ngram"}) == SpeculativeConfig()
    for bad, match in [
        ("{not json", "speculative_config must be a JSON object"),
        ("[1]", "must be a JSON object, got list"),
        ({"method": "eagle"}, r"speculative_config.method must be one of \('ngram',\)"),
        ({"model": "x"}, r"unknown key\(s\) \['model'\]"),
        ({"num_speculative_tokens": 0}, r"num_speculative_tokens must be an integer in \[1, 32\]"),
        ({"num_speculative_tokens": 33}, r"num_speculative_tokens must be an integer in \[1, 32\]"),
        ({"num_speculative_tokens": True}, "num_speculative_tokens must be an integer"),
        ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min \\(4\\) must be <= prompt_lookup_max"),
        ({"disable_by_batch_size": 1}, r"disable_by_batch_size must be an integer >= 2 or null"),
    ]:
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig.parse(bad)


# == through the engine ==============================================================================
@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    from tiny_models import make_tiny_checkpoint

    return make_tiny_checkpoint("llama", pathlib.Path(tmp_path_factory.mktemp("spec-llama")), dtype=torch.float32)


def _tokens(llm: LLM, prompts: list[list[int]], params) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def _spec_stats(llm: LLM) -> dict[str, int]:
    return {k: v for k, v in llm.engine.get_stats().items() if k.startswith("spec_decode")}


def test_greedy_equals_transformers_and_plain(llama):
    from tiny_models import hf_greedy

    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = hf_greedy(llama, PROMPTS, 40)
    spec = LLM(llama, speculative_config=NGRAM, **ENGINE)
    assert _tokens(spec, PROMPTS, params) == want
    stats = _spec_stats(spec)
    assert stats["spec_decode_draft_tokens"] > 0 and stats["spec_decode_drafts"] > 0
    assert 0 <= stats["spec_decode_accepted_tokens"] <= stats["spec_decode_draft_tokens"]
    # max_tokens holds exactly though a step may yield up to 5 tokens; each length is its own.
    lengths = [3, 7, 12]
    got = spec.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths])
    assert [list(o.outputs[0].token_ids) for o in got] == [w[:n] for w, n in zip(want, lengths)]
    assert spec.engine.get_stats()["kv_blocks_used"] == 0  # nothing left held


def test_sampling_logprobs_and_mixed_batches_equal_plain(llama):
    """Seeded random rows keep their tokens (a draft is kept only where the row's own draw
    picks it); logprobs come for every kept token; a grammar row (no drafts) and penalised rows
    share the batch."""
    spec = LLM(llama, speculative_config=NGRAM, **ENGINE)
    plain = LLM(llama, **ENGINE)
    params = [SamplingParams(temperature=0.8, seed=11, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3,
                             presence_penalty=0.5, min_tokens=5)]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    got, ref = spec.generate(prompts, params), plain.generate(prompts, params)
    for g, r in zip(got, ref):
        assert list(g.outputs[0].token_ids) == list(r.outputs[0].token_ids)
    g_lp, r_lp = got[1].outputs[0].logprobs, ref[1].outputs[0].logprobs
    assert len(g_lp) == len(r_lp) == 30
    for a, b in zip(g_lp, r_lp):
        assert a.sampled.token_id == b.sampled.token_id and a.sampled.logprob == pytest.approx(b.sampled.logprob, abs=1e-4)
        assert [t.token_id for t in a.top] == [t.token_id for t in b.top]
    assert _spec_stats(spec)["spec_decode_draft_tokens"] > 0


def test_preemption_and_prefix_cache_keep_outputs(llama):
    """A cache small enough to preempt while drafts are in flight; then a prompt that is a finished
    request's prompt + output hits the blocks speculation published: if a rejected draft's KV had
    been published, its continuation would differ from transformers'."""
    from tiny_models import hf_greedy

    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    want = hf_greedy(llama, PROMPTS, 48)
    small = LLM(llama, speculative_config=NGRAM, num_kv_blocks=16, max_model_len=128, block_size=8)
    assert _tokens(small, PROMPTS, params) == want
    assert small.engine.get_stats()["num_preemptions"] > 0
    spec = LLM(llama, speculative_config=NGRAM, **ENGINE)
    assert _tokens(spec, PROMPTS[2:], params) == want[2:]
    longer = PROMPTS[2] + want[2][:40]  # 90 tokens: 5 full blocks, prompt and decoded ones
    before = spec.engine.get_stats()["prefix_cache_hits"]
    follow = hf_greedy(llama, [longer], 16)
    assert _tokens(spec, [longer], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)) == follow
    assert spec.engine.get_stats()["prefix_cache_hits"] - before >= 80


def test_repeating_model_accepts_most_drafts(tmp_path):
    """A model with small weights repeats itself: nearly every draft is right, and a step yields
    several tokens (fewer steps than tokens)."""
    from tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint("llama", tmp_path / "rep", dtype=torch.float32, initializer_range=0.01)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    plain = _tokens(LLM(path, **ENGINE), PROMPTS[:1], params)
    spec = LLM(path, speculative_config=NGRAM, **ENGINE)
    assert _tokens(spec, PROMPTS[:1], params) == plain
    stats = _spec_stats(spec)
    assert stats["spec_decode_accepted_tokens"] >= 0.5 * stats["spec_decode_draft_tokens"] > 0
    assert stats["spec_decode_drafts"] < 63  # fewer checking steps than tokens after the first
    # disable_by_batch_size: three requests running side by side check no drafts, one alone does.
    off = LLM(path, speculative_config={**NGRAM, "disable_by_batch_size": 2}, **ENGINE)
    three = _tokens(off, PROMPTS, params)
    assert three[0] == plain[0] and _spec_stats(off)["spec_decode_drafts"] == 0
    assert _tokens(off, PROMPTS[:1], params) == plain and _spec_stats(off)["spec_decode_drafts"] > 0


def test_stop_strings_and_eos_inside_accepted_drafts(tmp_path):
    """A stop string or eos that lands inside a step's accepted tokens ends the output exactly
    where the plain engine ends it."""
    from bytelevel_tiny import make_bytelevel_checkpoint

    path = make_bytelevel_checkpoint(tmp_path / "bl")
    spec = LLM(path, speculative_config=NGRAM, **ENGINE)
    plain = LLM(path, **ENGINE)
    prompt = "abcabcabcabcabc"
    free = plain.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))[0].outputs[0]
    stop = free.text[10:13]  # a string the output is known to hold
    for params in (SamplingParams(temperature=0.0, max_tokens=40, stop=[stop]),
                   SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[free.token_ids[9]]),
                   SamplingParams(temperature=0.0, max_tokens=40)):
        a = spec.generate([prompt], params)[0].outputs[0]
        b = plain.generate([prompt], params)[0].outputs[0]
        assert (a.text, list(a.token_ids), a.finish_reason) == (b.text, list(b.token_ids), b.finish_reason)
    assert spec.engine.get_stats()["kv_blocks_used"] == 0
