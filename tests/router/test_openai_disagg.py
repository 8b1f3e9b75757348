"""Issue 18's OpenAI features disaggregated: `pdcluster serve --prefill 1 --decode 1` (real
processes, P2P KV hand-off) with the official `openai` client. The prefill leg samples the first
constrained token, the decode leg continues the grammar after it: the answers validate and equal
the offline (aggregated) engine's token for token; n, top_logprobs and refusals behave as in the
aggregated runs (test_openai_features.py)."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import jsonschema
import openai
import pytest
from serve_procs import start_serve, stop_serve

from pdcluster import LLM, SamplingParams

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                           "sunny": {"type": "boolean"}},
          "required": ["city", "sunny"], "additionalProperties": False}
MSGS = [{"role": "user", "content": "Which city? Answer in JSON."}]


@pytest.fixture(scope="module")
def served(demo_model):
    proc, ready = start_serve(["--model", demo_model, "--prefill", "1", "--decode", "1", "--policy", "round_robin",
                               "--worker-args", "--max-model-len 256"])
    try:
        yield ready
    finally:
        stop_serve(proc)


@pytest.fixture(scope="module")
def offline(demo_model):
    return LLM(demo_model, max_model_len=256)


def _client(ready) -> openai.OpenAI:
    return openai.OpenAI(base_url=ready["http"] + "/v1", api_key="unused", max_retries=0, timeout=120)


def _model(oa) -> str:
    return oa.models.list().data[0].id


def _disaggregated_count(ready) -> float:
    text = urllib.request.urlopen(ready["http"] + "/metrics", timeout=10).read().decode()
    lines = [ln for ln in text.splitlines()
             if ln.startswith('pdcluster_router_disaggregated_requests_total{mode="disaggregated"}')]
    return float(lines[0].split()[-1]) if lines else 0.0


def test_structured_output_disaggregated(served, offline):
    oa = _client(served)
    model = _model(oa)
    before = _disaggregated_count(served)
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    r = oa.chat.completions.create(model=model, messages=MSGS, response_format=fmt, max_tokens=60, temperature=0.8,
                                   seed=3)
    want = offline.chat(MSGS, SamplingParams(structured_outputs={"json": SCHEMA}, max_tokens=60, temperature=0.8,
                                             seed=3))[0].outputs[0]
    assert r.choices[0].message.content == want.text and r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    chunks = list(oa.chat.completions.create(model=model, messages=MSGS, response_format=fmt, max_tokens=60,
                                             temperature=0, stream=True))
    jsonschema.validate(json.loads("".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)), SCHEMA)
    choices = ["alpha", "beta", "gamma"]
    r = oa.completions.create(model=model, prompt="Pick:", max_tokens=8, n=2, temperature=1.0, seed=9,
                              extra_body={"guided_choice": choices})
    assert len(r.choices) == 2 and all(ch.text in choices for ch in r.choices)
    r = oa.completions.create(model=model, prompt="Id:", max_tokens=12, temperature=1.0, seed=2,
                              extra_body={"guided_regex": "[a-f]{4}[0-9]"})
    assert re.fullmatch("[a-f]{4}[0-9]", r.choices[0].text)
    assert _disaggregated_count(served) >= before + 5  # every one ran as prefill leg + decode leg


def test_logprobs_and_refusals_disaggregated(served, offline):
    oa = _client(served)
    model = _model(oa)
    r = oa.chat.completions.create(model=model, messages=MSGS, max_tokens=4, temperature=0, logprobs=True,
                                   top_logprobs=3, extra_body={"ignore_eos": True})
    want = offline.chat(MSGS, SamplingParams(max_tokens=4, temperature=0, logprobs=3, ignore_eos=True))[0].outputs[0]
    content = r.choices[0].logprobs.content
    assert len(content) == 4  # the prefill leg's token and the decode leg's
    for got, w in zip(content, want.logprobs):
        assert got.logprob == pytest.approx(w.sampled.logprob, abs=1e-4)
        assert [t.logprob for t in got.top_logprobs] == pytest.approx([t.logprob for t in w.top], abs=1e-4)
    with pytest.raises(openai.BadRequestError) as e:
        oa.completions.create(model=model, prompt="x", max_tokens=4, extra_body={"guided_regex": "(("})
    assert e.value.body["param"] == "guided_regex"
    body = json.dumps({"prompt": "x", "unknown_thing": 1}).encode()
    req = urllib.request.Request(served["http"] + "/v1/completions", body, {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as http_err:
        urllib.request.urlopen(req, timeout=30)
    assert http_err.value.code == 400 and json.loads(http_err.value.read())["error"]["param"] == "unknown_thing"


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                            "unit": {"type": "string", "enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]


def test_prompt_logprobs_disaggregated(served, offline):
    """The prefill leg computes the prompt's logprobs and they reach the client with its token; the
    decode leg (which loads the KV) is sent without them."""
    oa = _client(served)
    model = _model(oa)
    prompt = "def parse(text):\n    return"
    want = offline.generate([prompt], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, prompt_logprobs=1,
                                                     logprobs=0))[0]
    before = _disaggregated_count(served)
    r = oa.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True, "prompt_logprobs": 1})
    got = r.choices[0].model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(want.prompt_logprobs) + 1
    for entry, w in zip(got[1:], want.prompt_logprobs):
        assert entry[str(w.sampled.token_id)]["logprob"] == pytest.approx(w.sampled.logprob, abs=1e-4)
        assert entry[str(w.sampled.token_id)]["rank"] == w.sampled.rank
    assert r.choices[0].text == want.outputs[0].text
    r = oa.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0, echo=True, logprobs=0,
                              extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([w.sampled.logprob for w in want.prompt_logprobs
                                                   + want.outputs[0].logprobs], abs=1e-4)
    assert _disaggregated_count(served) >= before + 2


def test_required_tool_call_disaggregated(served):
    oa = _client(served)
    model = _model(oa)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = oa.chat.completions.create(model=model, messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS,
                                       tool_choice=choice, max_tokens=120, temperature=0.7, seed=4,
                                       parallel_tool_calls=False)  # one call: the answer is bounded
        assert r.choices[0].finish_reason == "tool_calls"
        calls = r.choices[0].message.tool_calls
        assert calls and all(c.function.name == "get_weather" for c in calls)
        for c in calls:
            jsonschema.validate(json.loads(c.function.arguments), WEATHER)


def test_token_masks_and_continued_messages_disaggregated(served, offline):
    """allowed_token_ids and bad_words on both legs (the prefill leg samples the first token under
    them, the decode leg matches bad words across it) and a continued final message: the
    offline (aggregated) engine's tokens."""
    oa = _client(served)
    model = _model(oa)
    before = _disaggregated_count(served)
    tok = offline.tokenizer
    free = offline.generate(["Hello"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    from pdcluster.bad_words import tokenize_bad_words

    ids = list(free.token_ids)
    # Two output tokens whose text, as a bad word, tokenizes back to them: the ban must bite.
    word = next(w for i in range(len(ids) - 1) if (w := tok.decode(ids[i:i + 2])) and w == w.strip()
                and tuple(ids[i:i + 2]) in tokenize_bad_words([w], lambda t: tok.encode(t, add_special_tokens=False)))
    allowed = sorted(set(free.token_ids) | set(tok.encode(" the", add_special_tokens=False)))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, bad_words=[word], allowed_token_ids=allowed)
    want = offline.generate(["Hello"], params)[0].outputs[0]
    r = oa.completions.create(model=model, prompt="Hello", max_tokens=12, temperature=0,
                              extra_body={"ignore_eos": True, "bad_words": [word], "allowed_token_ids": allowed,
                                          "return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == list(want.token_ids) and r.choices[0].text == want.text
    assert list(want.token_ids) != list(free.token_ids)
    msgs = [*MSGS, {"role": "assistant", "content": '{"city": "'}]
    want = offline.chat(msgs, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        add_generation_prompt=False, continue_final_message=True)[0].outputs[0].text
    r = oa.chat.completions.create(model=model, messages=msgs, max_tokens=6, temperature=0,
                                   extra_body={"ignore_eos": True, "continue_final_message": True,
                                               "add_generation_prompt": False})
    assert r.choices[0].message.content == want
    assert _disaggregated_count(served) >= before + 2
