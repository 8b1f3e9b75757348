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

# adaptive off: every draft found is checked, whatever this machine's step costs (draft_policy.py);
# the adaptive policy has its own tests below, with step costs given, not measured.
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "adaptive": False}
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


def test_drafter_packs_each_request_once_and_follows_its_growth():
    from pdcluster.engine.ngram_proposer import NgramDrafter

    d = NgramDrafter(1, 3)
    prompt, out = [1, 2, 3, 9, 1, 2, 3, 8], [2, 3]
    assert d.propose("a", prompt, out, 3) == propose_ngram(prompt + out, 1, 3, 3) == [8, 2, 3]
    out += [8, 2, 3]  # the output grew: only the new tokens are packed
    assert d.propose("a", prompt, out, 2) == propose_ngram(prompt + out, 1, 3, 2)
    assert d.propose("b", [7, 7], [], 2) == [7, 7]  # requests are kept apart
    d.forget("a")
    assert d.propose("a", [5, 6], [], 2) == []  # a new request of the same id starts afresh


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
    assert cfg == SpeculativeConfig("ngram", 3, 5, 5) and cfg.adaptive
    assert not SpeculativeConfig.parse({"adaptive": False}).adaptive
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
        ({"adaptive": "yes"}, "speculative_config.adaptive must be true or false"),
    ]:
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig.parse(bad)


# == the adaptive draft policy (pure: step costs given) ================================================
def _policy(costs: dict[int, float], share: float = 0.6, max_drafts: int = 4):
    from pdcluster.engine.draft_policy import DraftPolicy

    p = DraftPolicy(max_drafts, share=share)
    for rows, ms in costs.items():
        p.record_step(rows, 1.0)  # a row count's first step is not a price, whatever it took
        p.record_step(rows, ms / 1e3)
    return p


def test_policy_prices_ignore_first_steps_and_damp_spikes():
    from pdcluster.engine.draft_policy import ALPHA, SPIKE, DraftPolicy

    p = DraftPolicy(4)
    p.record_step(5, 0.012)  # the first 5-row step: one-time costs
    assert p.step_time(5) is None
    p.record_step(5, 0.009)
    assert p.step_time(5) == pytest.approx(0.009)
    p.record_step(5, 0.020)  # a one-thread probe: counts as SPIKE x the average
    assert p.step_time(5) == pytest.approx(0.009 + ALPHA * (SPIKE - 1) * 0.009)
    for _ in range(40):  # a lasting rise still gets through
        p.record_step(5, 0.020)
    assert p.step_time(5) == pytest.approx(0.020, rel=0.02)
    for _ in range(40):  # and a fall at once
        p.record_step(5, 0.008)
    assert p.step_time(5) == pytest.approx(0.008, rel=0.02)


def test_policy_checks_drafts_while_rows_are_cheap():
    # Batch 1 of the 125M Llama on a 2-core AVX2 CPU: a row costs little up to 3, then a lot.
    weight_read = {1: 7.4, 2: 7.7, 3: 8.2, 4: 10.5, 5: 11.4}
    assert _policy(weight_read).plan(1, [("r", 4)]) == {"r": 2}
    # A request keeping nearly everything is worth the fourth row too; one keeping little, one row.
    good = _policy(weight_read)
    for _ in range(20):
        good.record_check("good", 4, 4)
        good.record_check("poor", 2, 0)
    assert good.kept_share("good") > 0.85 > 0.2 > good.kept_share("poor")
    plan = good.plan(1, [("good", 4), ("poor", 4)])
    assert plan["good"] >= 3 and "poor" not in plan
    # Never more than the request has, or than max_drafts.
    assert _policy(weight_read, share=1.0).plan(1, [("r", 1)]) == {"r": 1}
    assert _policy({1: 1.0, 9: 1.0}, share=1.0, max_drafts=2).plan(1, [("r", 5)]) == {"r": 2}


def test_policy_skips_drafts_when_rows_cost_their_share():
    # Arithmetic-bound: every row adds 1/8 of a batch-8 step; kept half the time, no draft pays.
    linear = {r: 0.17 * r for r in range(1, 25)}
    p = _policy(linear, share=0.5)
    assert p.plan(8, [(f"r{i}", 4) for i in range(8)]) == {}
    # ... but every EXPLORE_EVERY-th step one request (in turn) checks one draft: its share is
    # measured again.
    from pdcluster.engine.draft_policy import EXPLORE_EVERY

    plans = [p.plan(8, [("a", 4), ("b", 4)]) for _ in range(2 * EXPLORE_EVERY - 1)]
    explored = [plan for plan in plans if plan]
    assert len(explored) == 2 and sorted(map(tuple, (e.items() for e in explored))) == [(("a", 1),), (("b", 1),)]


def test_policy_cost_estimates():
    p = _policy({2: 10.0, 6: 14.0})
    assert p.step_time(4) == pytest.approx(0.012)  # between measured counts: linear
    assert p.step_time(1) == pytest.approx(0.010)  # below them: the smallest's
    assert p.step_time(8) == pytest.approx(0.016)  # past them: the last slope
    assert _policy({}).step_time(3) is None and _policy({3: 5.0}).step_time(9) == pytest.approx(0.005)
    # Noise that says more rows cost less is flattened: t never falls as rows grow.
    noisy = _policy({7: 1.48, 8: 1.42, 9: 1.56})
    assert noisy.step_time(8) == pytest.approx(0.00148) and noisy.step_time(9) == pytest.approx(0.00156)
    # Nothing measured yet: drafts are checked (and so the larger row counts get measured).
    assert _policy({}).plan(1, [("r", 3)]) == {"r": 3}
    # Non-adaptive: every draft found, up to max_drafts.
    from pdcluster.engine.draft_policy import DraftPolicy

    assert DraftPolicy(2, adaptive=False).plan(8, [("a", 5), ("b", 1), ("c", 0)]) == {"a": 2, "b": 1}
    q = _policy({1: 1.0})
    q.record_check("x", 3, 3)
    q.forget("x")
    assert q.kept_share("x") == pytest.approx(q.share)


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
    # The adaptive policy (the default) checks what this machine's costs say: outputs are the same.
    adaptive = LLM(llama, speculative_config={"method": "ngram", "prompt_lookup_min": 1}, **ENGINE)
    assert _tokens(adaptive, PROMPTS, params) == want
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
    picks it); logprobs come for every kept token; penalised rows share the batch."""
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


def test_sliding_window_model_equals_transformers(tiny_ckpts):
    """Phi-3's window (40) frees blocks behind it while drafts run past the window's edge: rows of
    one request read different windows, and the freed blocks never come back. Greedy tokens equal
    transformers' past two windows."""
    from tiny_models import hf_greedy

    path = tiny_ckpts("phi3")
    prompts = [[5, 6, 7, 8, 9, 10] * 4, list(range(30, 75))]
    want = hf_greedy(path, prompts, 64)
    spec = LLM(path, speculative_config=NGRAM, max_model_len=256, block_size=8)
    assert _tokens(spec, prompts, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)) == want
    stats = spec.engine.get_stats()
    assert stats["spec_decode_draft_tokens"] > 0 and stats["kv_blocks_used"] == 0


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
    stats = spec.engine.get_stats()
    assert stats["kv_blocks_used"] == 0 and stats["spec_decode_drafts"] > 0


def test_grammar_requests_check_drafts_and_equal_plain(tmp_path):
    """A request under a grammar checks drafts too: each row is masked in the matcher's state after
    the drafts before it (rolled back after), and the matcher advances by the kept tokens only.
    Outputs equal the plain engine's, greedy and seeded: a grammar that forces the drafted text
    (drafts kept), one that refuses the drafts part way (the rows after a refused draft are never
    kept), a choice, and a JSON schema after a prompt that spells its answer."""
    from bytelevel_tiny import make_bytelevel_checkpoint

    path = make_bytelevel_checkpoint(tmp_path / "bl")
    spec = LLM(path, speculative_config=NGRAM, **ENGINE)
    plain = LLM(path, **ENGINE)
    schema = {"type": "object", "properties": {"name": {"type": "string", "enum": ["ada", "bob"]},
                                               "ok": {"type": "boolean"}},
              "required": ["name", "ok"], "additionalProperties": False}
    cases = [("abcabcabcabcabc", {"regex": "(abc){5}"}),  # forced: every draft from the prompt is kept
             ("abcabcabcabcabc", {"regex": "(abc){3}[0-9]+"}),  # the fourth "abc" drafted, refused
             ("abcabcabcabcabc", {"choice": ["abcabcabd", "abcabcabcabcabcX"]}),
             ('{"name":"ada","ok":true} {"name":"ada","ok":true} ', {"json": schema})]
    for prompt, so in cases:
        for kw in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 7}):
            params = SamplingParams(max_tokens=24, structured_outputs=so, **kw)
            before = _spec_stats(spec)
            a = spec.generate([prompt], params)[0].outputs[0]
            b = plain.generate([prompt], params)[0].outputs[0]
            assert (a.text, list(a.token_ids), a.finish_reason) == (b.text, list(b.token_ids), b.finish_reason), so
            after = _spec_stats(spec)
            assert after["spec_decode_draft_tokens"] > before["spec_decode_draft_tokens"], so
    forced = spec.generate(["abcabcabcabcabc"], SamplingParams(temperature=0.0, max_tokens=24,
                                                               structured_outputs={"regex": "(abc){5}"}))[0].outputs[0]
    assert forced.text == "abc" * 5 and forced.finish_reason == "stop"
    stats = spec.engine.get_stats()
    assert stats["spec_decode_accepted_tokens"] > 0 and stats["kv_blocks_used"] == 0
