"""Structured output in the engine (xgrammar): every kind of spec constrains the offline engine's
output, greedy and sampled; grammars are compiled once per spec and the cache is bounded; a bad
spec is a ValueError naming the field before anything runs; a decode leg that starts after a
prefill leg's token continues the grammar (the disaggregated split gives the aggregated output)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from bytelevel_tiny import make_bytelevel_checkpoint

from pdcluster import LLM, SamplingParams
from pdcluster.proto_convert import sampling_params_from_proto, sampling_params_to_proto
from pdcluster.structured_spec import StructuredOutputs

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "enum": ["ada", "bob"]},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    return LLM(make_bytelevel_checkpoint(tmp_path_factory.mktemp("bl") / "m"), max_model_len=256)


def _gen(llm: LLM, so: dict, prompt: str = "hello", **kw) -> object:
    kw.setdefault("max_tokens", 64)
    return llm.generate([prompt], SamplingParams(structured_outputs=so, **kw))[0].outputs[0]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_validates(llm, temperature):
    for seed in range(3):
        out = _gen(llm, {"json": SCHEMA}, temperature=temperature, seed=seed)
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_choice_regex_grammar_json_object(llm):
    for seed in range(4):
        assert _gen(llm, {"choice": ["yes", "no", "maybe"]}, temperature=1.0, seed=seed).text in {"yes", "no", "maybe"}
        assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", _gen(llm, {"regex": "[a-c]{3}-[0-9]{2}"}, temperature=1.0,
                                                            seed=seed).text)
        assert re.fullmatch(r"x[0-9]+y", _gen(llm, {"grammar": 'root ::= "x" [0-9] [0-9]? "y"'}, temperature=1.0,
                                               seed=seed).text)
    for seed in range(3):  # an object, never another JSON value; it may run to max_tokens (long strings)
        out = _gen(llm, {"json_object": True}, temperature=1.0, seed=seed, max_tokens=120)
        assert out.text.startswith("{"), out.text
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)


def test_constrained_and_free_requests_share_a_batch(llm):
    free = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = llm.generate(["hello"], free)[0].outputs[0].token_ids
    outs = llm.generate(["hello", "hello"], [SamplingParams(structured_outputs={"choice": ["no"]}, max_tokens=8), free])
    assert outs[0].outputs[0].text == "no" and outs[1].outputs[0].token_ids == want


def test_grammar_compiled_once_and_cache_bounded(llm):
    cache = llm.engine.core.runner.grammar_cache()
    spec = StructuredOutputs(regex="[0-9]{4}")
    first = cache.compile(spec)
    _gen(llm, {"regex": "[0-9]{4}"})
    assert cache.compile(StructuredOutputs(regex="[0-9]{4}")) is first
    for i in range(cache._max + 5):
        cache.compile(StructuredOutputs(regex=f"a{{{i + 1}}}"))
    assert len(cache) == cache._max


@pytest.mark.parametrize("so,field", [({"regex": "("}, "structured_outputs.regex"),
                                      ({"json": {"type": "objectx"}}, "structured_outputs.json"),
                                      ({"grammar": "root ::= "}, "structured_outputs.grammar")])
def test_uncompilable_spec_is_a_value_error(llm, so, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate(["hi"], SamplingParams(structured_outputs=so))


def test_a_spec_no_token_can_begin_is_a_value_error(tmp_path):
    """A word-level vocabulary cannot spell `{`: every row would be masked to nothing. Refused by
    name at admission; a spec it can begin is served, and the engine goes on."""
    from tiny_models import make_tiny_checkpoint

    llm = LLM(make_tiny_checkpoint("llama", tmp_path / "w"), max_model_len=128)
    with pytest.raises(ValueError, match=r"structured_outputs\.json: no token of this model's vocabulary"):
        llm.generate(["hi"], SamplingParams(structured_outputs={"json": {"type": "object"}}))
    # "t7": no shorter token spells a prefix of it ("t" is none), so the grammar's only way is it
    word = "t7"
    out = llm.generate(["hi"], SamplingParams(max_tokens=4, structured_outputs={"choice": [word]}))[0].outputs[0]
    assert out.text.strip() == word and out.finish_reason == "stop"
    # One it can begin but not go on with (its tokens carry no space): the request ends at the
    # first row the grammar leaves empty, by name, instead of running on unconstrained.
    res = llm.generate(["hi"], SamplingParams(max_tokens=8, structured_outputs={"regex": f"{word}( {word})+"}))[0]
    assert res.outputs[0].finish_reason == "error" and res.error_field == "structured_outputs"
    assert res.error == "structured_outputs: the grammar allows no token of this model's vocabulary after 1 output tokens"
    assert res.outputs[0].text.strip() == word
    assert llm.engine.get_stats()["kv_blocks_used"] == 0


def test_masks_that_leave_a_row_no_token_fail_the_request_by_name(llm):
    """allowed_token_ids of only stop tokens with min_tokens: no token is left while min_tokens
    holds (this one is refused at admission, so the sampler is driven directly). Such a row fails
    its request with a RequestFault naming the fields instead of sampling a token they forbid;
    its neighbour in the batch is sampled as ever, and a failed row's grammar is not advanced."""
    import torch

    from pdcluster.engine.sampler import Sampler, SamplingState

    eos = llm.engine.tokenizer.eos_token_id
    vocab = llm.engine.tokenizer.vocab_size
    sampler = Sampler(vocab, seed=0)
    dead = SamplingState(SamplingParams(allowed_token_ids=[eos]), [1, 2], [], (eos,))
    object.__setattr__(dead.params, "min_tokens", 3)  # what admission refuses, past it
    free = SamplingState(SamplingParams(temperature=0.0), [1, 2], [], (eos,))
    logits = torch.randn(2, vocab)
    tokens, _ = sampler(logits, [dead, free])
    assert dead.fault is not None and dead.fault.field == "allowed_token_ids"
    assert dead.fault.message == "allowed_token_ids and min_tokens together leave no token to sample after 0 output tokens"
    assert free.fault is None and tokens[1] == int(logits[1].argmax())


def _nested(levels: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(levels - 1):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("kw,field", [({"structured_outputs": {"json": "{nope"}}, "structured_outputs.json"),
                                      # deeper than json.loads' stack (was a RecursionError), and than
                                      # what xgrammar compiles quickly (900 levels: 40 s), as text or object
                                      ({"structured_outputs": {"json": "[" * 5000}}, "nests deeper than 64"),
                                      ({"structured_outputs": {"json": _nested(65)}}, "nests deeper than 64"),
                                      ({"structured_outputs": {"json": json.dumps(_nested(65))}}, "nests deeper"),
                                      ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
                                      ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
                                      ({"structured_outputs": {"regex": "a"}, "ignore_eos": True}, "ignore_eos"),
                                      ({"logit_bias": {5: 500}}, "logit_bias"),
                                      ({"logit_bias": {-1: 1}}, "logit_bias")])
def test_malformed_params(kw, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        SamplingParams(**kw)


def test_params_round_trip_through_proto_and_dict():
    sp = SamplingParams(structured_outputs={"json": SCHEMA}, logit_bias={"7": 1.5, 3: -2})
    assert sampling_params_from_proto(sampling_params_to_proto(sp)) == sp
    assert SamplingParams.from_dict(sp.to_dict()) == sp
    assert sp.logit_bias == ((3, -2.0), (7, 1.5))
    sp = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert sampling_params_from_proto(sampling_params_to_proto(sp)) == sp


def test_decode_leg_continues_the_grammar(llm):
    """Prefill leg: one constrained token. Decode leg: the same prompt with that token as prior
    output; the matcher is advanced over it, so the result is the aggregated one."""
    params = SamplingParams(structured_outputs={"json": SCHEMA}, temperature=0.8, seed=3, max_tokens=64)
    whole = llm.generate(["hi"], params)[0].outputs[0]
    first = llm.generate(["hi"], params.replace(max_tokens=1))[0].outputs[0].token_ids
    engine = llm.engine
    req, text = engine.prepare_request("hi", params, prefill_output_token_ids=list(first))
    engine.add_prepared(req, text)
    while engine.has_unfinished_requests():
        engine.step()
    rest = engine.get_final(req.request_id).outputs[0]
    assert list(first) + list(rest.token_ids) == list(whole.token_ids)
    jsonschema.validate(json.loads(whole.text), SCHEMA)


def test_logit_bias_forces_a_token(llm):
    tok = llm.tokenizer.encode("Z", add_special_tokens=False)[0]
    out = llm.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                 logit_bias={tok: 100}))[0].outputs[0]
    assert list(out.token_ids) == [tok] * 4
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(["hello"], SamplingParams(logit_bias={10**6: 1}))


def test_tensor_parallel_ranks_follow_the_grammar(llm):
    """TP: the spec and logit_bias reach rank 1 in the step broadcast (to_dict), each rank builds
    its own matcher, and the tokens are the single-process engine's."""
    params = SamplingParams(structured_outputs={"json": SCHEMA}, temperature=0.9, seed=4, max_tokens=60,
                            logit_bias={5: 3})
    want = [o.outputs[0].token_ids for o in llm.generate(["hi", "yo"], params)]
    tp = LLM(llm.engine.config.tokenizer_path, max_model_len=256, tensor_parallel_size=2)
    try:
        got = tp.generate(["hi", "yo"], params)
    finally:
        tp.shutdown()
    assert [o.outputs[0].token_ids for o in got] == want
    for o in got:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)


def _props(n: int, required: int = 0) -> dict:
    return {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(n)},
            "required": [f"k{i}" for i in range(required)]}


def test_optional_properties_are_bounded():
    """Optional properties make xgrammar's compile cost grow faster than linearly (2000 of them:
    tens of seconds), so a schema is refused past the bounds, naming the field; required ones are
    not bounded (they compile in no time)."""
    from pdcluster.structured_spec import MAX_OPTIONAL_PROPERTIES, MAX_OPTIONAL_PROPERTIES_TOTAL

    StructuredOutputs(json=_props(MAX_OPTIONAL_PROPERTIES))
    StructuredOutputs(json=_props(MAX_OPTIONAL_PROPERTIES + 600, required=600))
    with pytest.raises(ValueError, match=f"structured_outputs.json: .*{MAX_OPTIONAL_PROPERTIES + 1} optional"):
        StructuredOutputs(json=_props(MAX_OPTIONAL_PROPERTIES + 1))
    nested = {"type": "array", "items": [{"anyOf": [_props(MAX_OPTIONAL_PROPERTIES)]} for _ in range(5)]}
    with pytest.raises(ValueError, match=f"more than {MAX_OPTIONAL_PROPERTIES_TOTAL} optional properties"):
        StructuredOutputs(json=nested)
    with pytest.raises(ValueError, match="structured_outputs.json"):  # the engine's params say the same
        SamplingParams(structured_outputs={"json": _props(MAX_OPTIONAL_PROPERTIES + 1)})


def test_the_async_engine_compiles_grammars_off_the_event_loop(llm, monkeypatch):
    """A grammar compiles on a worker thread (xgrammar releases the GIL): a slow schema leaves the
    server's event loop, its health checks and every other stream running."""
    import asyncio
    import threading

    from pdcluster.config import EngineArgs
    from pdcluster.engine.async_engine import AsyncEngine
    from pdcluster.engine.llm_engine import LLMEngine

    path = llm.engine.config.model.model_path  # the module's byte-level checkpoint, in an engine of its own
    engine = AsyncEngine(lambda: LLMEngine.from_engine_args(EngineArgs(model=path, max_model_len=256)))
    threads: list[threading.Thread] = []
    compile_grammar = engine.engine.check_grammar
    monkeypatch.setattr(engine.engine, "check_grammar",
                        lambda params: (threads.append(threading.current_thread()), compile_grammar(params))[1])

    async def run() -> tuple[threading.Thread, list]:
        sp = SamplingParams(structured_outputs={"json": SCHEMA}, max_tokens=48, temperature=0.0)
        outs = [o async for o in engine.generate("hello", sp)]
        return threading.current_thread(), outs

    try:
        loop_thread, outs = asyncio.run(run())
    finally:
        engine.shutdown()
    assert len(threads) == 1 and threads[0] is not loop_thread
    jsonschema.validate(json.loads("".join(o.outputs[0].text for o in outs)), SCHEMA)


def test_a_deep_but_bounded_schema_is_taken():
    assert SamplingParams(structured_outputs={"json": _nested(64)}).structured_outputs is not None


def test_masks_after_drafts_are_the_matchers_after_them_and_are_rolled_back(tmp_path):
    """Speculative decoding's rows (apply_grammar_masks with drafts_before): row j of a request is
    masked as a matcher advanced over its first j drafts would mask it; the rows after a draft the
    grammar refuses are left alone; afterwards the shared matcher is where it was."""
    import torch

    from pdcluster.engine.structured_output import GrammarCompilerCache, apply_grammar_masks, build_state
    from pdcluster.engine.tokenizer import Tokenizer

    path = make_bytelevel_checkpoint(tmp_path / "m")
    tok = Tokenizer.from_pretrained(path)
    cache = GrammarCompilerCache.from_tokenizer(tok, 384, [2])
    spec = StructuredOutputs(regex="(abc){2}[0-9]")
    drafts = tok.encode("abcabca", add_special_tokens=False)  # the last one is refused: a digit is due
    assert len(drafts) == 7

    def allowed(logits: torch.Tensor) -> list[frozenset[int]]:
        return [frozenset(torch.nonzero(row > float("-inf")).flatten().tolist()) for row in logits]

    shared = build_state(cache, spec, (2,), (), [])
    logits = torch.zeros(8, 384)
    apply_grammar_masks(logits, [shared] * 8, [drafts[:j] for j in range(8)])
    got = allowed(logits)
    for j in range(7):
        want = torch.zeros(1, 384)
        apply_grammar_masks(want, [build_state(cache, spec, (2,), (), drafts[:j])])
        assert got[j] == allowed(want)[0], j
    assert got[6] == frozenset(tok.encode("0123456789", add_special_tokens=False))
    assert got[7] == frozenset(range(384))  # after the refused draft: unmasked, never kept
    fresh = torch.zeros(1, 384)
    apply_grammar_masks(fresh, [build_state(cache, spec, (2,), (), [])])
    again = torch.zeros(1, 384)
    apply_grammar_masks(again, [shared])
    assert allowed(again) == allowed(fresh) == [frozenset(tok.encode("a", add_special_tokens=False))]
