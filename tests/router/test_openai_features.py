"""The OpenAI features of issue 18 through the router's HTTP frontend, driven by the official
`openai` client against real `serve-worker` processes (demo model, CPU, aggregated): structured
output (response_format, vLLM's guided_* and structured_outputs, streaming included), n/best_of,
logprobs and top_logprobs against the offline engine, echo, logit_bias, batched prompts,
/tokenize and /detokenize, and unknown or unsupported fields refused by name. The disaggregated
runs are in test_openai_disagg.py."""

from __future__ import annotations

import http.client
import json
import math
import re

import jsonschema
import openai
import pytest

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                           "sunny": {"type": "boolean"}},
          "required": ["city", "sunny"], "additionalProperties": False}
MSGS = [{"role": "user", "content": "Which city? Answer in JSON."}]


def client(c) -> openai.OpenAI:
    return openai.OpenAI(base_url=c.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def post(c, path: str, body: dict) -> tuple[int, dict]:
    host, port = c.http_url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    return resp.status, json.loads(raw) if raw else {}


def _model(c) -> str:
    return c.router.preprocessor.model_name


def test_json_schema_chat_and_stream(cluster):
    c = cluster(1)
    oa = client(c)
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    for temperature in (0.0, 1.0):
        r = oa.chat.completions.create(model=_model(c), messages=MSGS, response_format=fmt, max_tokens=60,
                                       temperature=temperature, seed=1)
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    chunks = list(oa.chat.completions.create(model=_model(c), messages=MSGS, response_format=fmt, max_tokens=60,
                                             temperature=0.7, seed=2, stream=True))
    jsonschema.validate(json.loads("".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)), SCHEMA)
    r = oa.chat.completions.create(model=_model(c), messages=MSGS, response_format={"type": "json_object"},
                                   max_tokens=120, temperature=0)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # the grammar allows long objects: a cut one is still a JSON object's beginning
        assert r.choices[0].message.content.lstrip().startswith("{")


def test_guided_fields_on_completions(cluster):
    c = cluster(1)
    oa = client(c)
    choices = ["red", "green", "blue"]
    r = oa.completions.create(model=_model(c), prompt="Colour:", max_tokens=8, temperature=1.0, n=2, seed=3,
                              extra_body={"guided_choice": choices})
    assert len(r.choices) == 2 and [ch.index for ch in r.choices] == [0, 1]
    assert all(ch.text in choices for ch in r.choices)
    r = oa.completions.create(model=_model(c), prompt="Code:", max_tokens=12, temperature=0.9, seed=4,
                              extra_body={"guided_regex": "[A-Z]{2}-[0-9]{3}"})
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", r.choices[0].text)
    r = oa.completions.create(model=_model(c), prompt="Data:", max_tokens=60, temperature=0,
                              extra_body={"structured_outputs": {"json": SCHEMA}})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    r = oa.completions.create(model=_model(c), prompt="N:", max_tokens=8, temperature=1.0, seed=5,
                              extra_body={"guided_grammar": 'root ::= "n=" [0-9] [0-9]?'})
    assert re.fullmatch(r"n=[0-9]{1,2}", r.choices[0].text)
    text = "".join(ch.choices[0].text for ch in oa.completions.create(
        model=_model(c), prompt="Colour:", max_tokens=8, stream=True, extra_body={"guided_choice": choices}))
    assert text in choices


BAD_STRUCTURED = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_regex": "([a-z]"}, "guided_regex"),
    ({"guided_grammar": "root ::= "}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
    ({"structured_outputs": {"jsonn": {}}}, "structured_outputs"),
    ({"guided_choice": ["a"], "ignore_eos": True}, "ignore_eos"),
]


@pytest.mark.parametrize("extra,param", BAD_STRUCTURED, ids=[p + str(i) for i, (_, p) in enumerate(BAD_STRUCTURED)])
def test_bad_structured_output_is_400_naming_the_field(cluster, extra, param):
    c = cluster(1)
    code, err = post(c, "/v1/completions", {"prompt": "x", "max_tokens": 4, **extra})
    assert code == 400 and err["error"]["param"] == param, err
    code, err = post(c, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 4, **extra})
    assert code == 400 and err["error"]["param"] == param, err


UNKNOWN = [({"prompt": "x", "frobnicate": 1}, "/v1/completions", "frobnicate"),
           ({"messages": MSGS, "audio": {}}, "/v1/chat/completions", "audio"),
           ({"prompt": "x", "suffix": "y"}, "/v1/completions", "suffix"),
           ({"messages": MSGS, "tools": [{"type": "function", "function": {"name": "bad name"}}]},
            "/v1/chat/completions", "tools"),
           ({"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f"}}],
             "tool_choice": {"type": "function", "function": {"name": "g"}}}, "/v1/chat/completions", "tool_choice"),
           ({"messages": MSGS, "tool_choice": "required"}, "/v1/chat/completions", "tool_choice"),
           ({"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
             "response_format": {"type": "json_object"}}, "/v1/chat/completions", "tool_choice"),
           ({"prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}, "/v1/completions", "tools"),
           ({"messages": MSGS, "top_logprobs": 2}, "/v1/chat/completions", "top_logprobs"),
           ({"prompt": "x", "echo": True, "logprobs": 1, "stream": True}, "/v1/completions", "echo"),
           ({"messages": MSGS, "prompt_logprobs": -1}, "/v1/chat/completions", "prompt_logprobs"),
           ({"prompt": "x", "n": 17}, "/v1/completions", "n"),
           ({"prompt": "x", "n": 2, "best_of": 1}, "/v1/completions", "best_of"),
           ({"prompt": "x", "best_of": 2, "stream": True}, "/v1/completions", "best_of"),
           ({"prompt": "x", "logit_bias": {"999999": 1}}, "/v1/completions", "logit_bias"),
           ({"prompt": "x", "logit_bias": {"5": 101}}, "/v1/completions", "logit_bias"),
           ({"prompt": ["a"] * 65}, "/v1/completions", "prompt"),
           # two definitions of one name: the later one would silently replace the earlier
           ({"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f"}}] * 2},
            "/v1/chat/completions", "tools"),
           # a forced call compiles the tools' parameter schemas (on the worker): its refusal names tools
           ({"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
             "tool_choice": "required"}, "/v1/chat/completions", "tools")]


@pytest.mark.parametrize("body,path,param", UNKNOWN, ids=[p + str(i) for i, (_, _, p) in enumerate(UNKNOWN)])
def test_unknown_and_unsupported_fields_are_refused_by_name(cluster, body, path, param):
    c = cluster(1)
    code, err = post(c, path, body)
    assert code == 400 and err["error"]["param"] == param, err


def test_n_best_of_and_batched_prompts(cluster, reference):
    c = cluster(2, policy="prefix_aware")
    oa = client(c)
    greedy = {"temperature": 0, "extra_body": {"ignore_eos": True}}
    want = [reference.generate(p, max_tokens=4).text for p in ("Hello", "World")]
    r = oa.completions.create(model=_model(c), prompt=["Hello", "World"], max_tokens=4, n=2, **greedy)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert [ch.text for ch in r.choices] == [want[0], want[0], want[1], want[1]]
    assert r.usage.completion_tokens == 16
    r = oa.completions.create(model=_model(c), prompt=[[5, 6, 7], [8, 9]], max_tokens=3, **greedy)
    assert [ch.text for ch in r.choices] == [reference.generate(p, max_tokens=3).text for p in ([5, 6, 7], [8, 9])]
    # best_of: the n best by cumulative logprob among best_of samples.
    r = oa.completions.create(model=_model(c), prompt="Hello", max_tokens=5, n=1, best_of=3, temperature=1.0,
                              seed=11, logprobs=0, extra_body={"ignore_eos": True})
    assert len(r.choices) == 1
    samples = [reference.generate("Hello", max_tokens=5, temperature=1.0, seed=11 + j, logprobs=0) for j in range(3)]
    best = max(samples, key=lambda s: sum(lp.sampled.logprob for lp in s.logprobs))
    assert r.choices[0].text == best.text
    # Seeded siblings differ (seed + j); n with chat, streamed: every index gets its chunks.
    r = oa.completions.create(model=_model(c), prompt="Hello", max_tokens=6, n=2, temperature=1.0, seed=5,
                              extra_body={"ignore_eos": True})
    assert [ch.text for ch in r.choices] == [reference.generate("Hello", max_tokens=6, temperature=1.0, seed=5 + j).text
                                             for j in range(2)]
    chunks = list(oa.chat.completions.create(model=_model(c), messages=MSGS, max_tokens=3, n=2, stream=True,
                                             stream_options={"include_usage": True}, **greedy))
    texts = {0: "", 1: ""}
    for ch in chunks:
        for choice in ch.choices:
            texts[choice.index] += choice.delta.content or ""
    want_chat = reference.chat(MSGS, max_tokens=3).text
    assert texts == {0: want_chat, 1: want_chat}
    assert chunks[-1].usage.completion_tokens == 6


def test_logprobs_match_the_offline_engine(cluster, reference):
    c = cluster(1)
    oa = client(c)
    r = oa.completions.create(model=_model(c), prompt=[5, 6, 7], max_tokens=4, temperature=0, logprobs=3,
                              extra_body={"ignore_eos": True})
    want = reference.generate([5, 6, 7], max_tokens=4, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    for got, w in zip(lp.token_logprobs, want.logprobs):
        assert math.isclose(got, w.sampled.logprob, rel_tol=1e-4, abs_tol=1e-4)
    for top, w in zip(lp.top_logprobs, want.logprobs):
        assert len(top) <= 3 and max(top.values()) == pytest.approx(w.top[0].logprob, abs=1e-4)
    r = oa.chat.completions.create(model=_model(c), messages=MSGS, max_tokens=3, temperature=0, logprobs=True,
                                   top_logprobs=2, extra_body={"ignore_eos": True})
    want = reference.chat(MSGS, max_tokens=3, logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 3
    for got, w in zip(content, want.logprobs):
        assert got.logprob == pytest.approx(w.sampled.logprob, abs=1e-4)
        assert [t.logprob for t in got.top_logprobs] == pytest.approx([t.logprob for t in w.top], abs=1e-4)
        assert len(got.top_logprobs) == 2


def test_prompt_logprobs_and_echo_with_logprobs(cluster, reference):
    """vLLM's prompt_logprobs (completions: per choice; chat: on the response) and echo with logprobs,
    against the offline engine: entry k + 1 scores prompt token k + 1, entry 0 is null."""
    from pdcluster import SamplingParams

    c = cluster(1)
    prompt = [5, 6, 7, 8, 9]
    full = reference.llm.generate([prompt], SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=2,
                                                           prompt_logprobs=2, logprobs=1))[0]
    code, body = post(c, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "temperature": 0,
                                             "ignore_eos": True, "prompt_logprobs": 2})
    assert code == 200, body
    got = body["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(prompt)
    for entry, w, token in zip(got[1:], full.prompt_logprobs, prompt[1:]):
        assert entry[str(token)]["logprob"] == pytest.approx(w.sampled.logprob, abs=1e-4)
        assert entry[str(token)]["rank"] == w.sampled.rank
        for t in w.top:
            assert entry[str(t.token_id)]["rank"] == t.rank
        assert len(entry) == 2 + (str(token) not in {str(t.token_id) for t in w.top})
    # echo + logprobs: the prompt's tokens (the first without a logprob) before the completion's.
    code, body = post(c, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "temperature": 0,
                                             "ignore_eos": True, "echo": True, "logprobs": 1})
    assert code == 200, body
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == len(prompt) + 2
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = [w.sampled.logprob for w in full.prompt_logprobs + full.outputs[0].logprobs]
    assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-4)
    assert lp["text_offset"] == sorted(lp["text_offset"])
    # chat: on the response, over the rendered conversation.
    full = reference.llm.chat(MSGS, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=2, prompt_logprobs=0))[0]
    code, body = post(c, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 2, "temperature": 0,
                                                  "ignore_eos": True, "prompt_logprobs": 0})
    assert code == 200, body
    got = body["prompt_logprobs"]
    assert got[0] is None and len(got) == len(full.prompt_logprobs) + 1
    assert [e[str(w.sampled.token_id)]["logprob"] for e, w in zip(got[1:], full.prompt_logprobs)] == pytest.approx(
        [w.sampled.logprob for w in full.prompt_logprobs], abs=1e-4)


def test_echo_and_logit_bias(cluster, reference):
    c = cluster(1)
    oa = client(c)
    r = oa.completions.create(model=_model(c), prompt="Hello there", max_tokens=3, temperature=0, echo=True,
                              extra_body={"ignore_eos": True})
    assert r.choices[0].text == "Hello there" + reference.generate("Hello there", max_tokens=3).text
    tok = reference.llm.tokenizer.encode("the", add_special_tokens=False)[0]
    r = oa.completions.create(model=_model(c), prompt=[5, 6], max_tokens=3, temperature=0,
                              logit_bias={str(tok): 100}, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3
    assert r.choices[0].text == reference.llm.tokenizer.decode([tok] * 3)


def test_allowed_token_ids_and_bad_words(cluster, reference):
    """vLLM's two sampling masks over HTTP: the offline engine's output under the same masks, no
    bad word's tokens in it, and a bad list refused naming the field."""
    c = cluster(1)
    oa = client(c)
    tok = reference.llm.tokenizer
    allowed = sorted({t for w in ("the", " cat", " sat", ".") for t in tok.encode(w, add_special_tokens=False)})
    r = oa.completions.create(model=_model(c), prompt="Hello", max_tokens=8, temperature=0,
                              extra_body={"ignore_eos": True, "allowed_token_ids": allowed})
    want = reference.generate("Hello", max_tokens=8, allowed_token_ids=allowed)
    assert set(want.token_ids) <= set(allowed) and r.choices[0].text == want.text
    free = reference.generate("Hello", max_tokens=16)
    word = tok.decode(list(free.token_ids[2:4])).strip()
    banned = reference.generate("Hello", max_tokens=16, bad_words=[word])
    r = oa.chat.completions.create(model=_model(c), messages=[{"role": "user", "content": "Hello"}], max_tokens=8,
                                   temperature=0, extra_body={"bad_words": [word], "ignore_eos": True})
    chat = reference.llm.tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], True, True)
    assert r.choices[0].message.content == reference.generate(chat, max_tokens=8, bad_words=[word]).text
    seqs = [tok.encode(w, add_special_tokens=False) for w in (word, " " + word)]
    ids = list(banned.token_ids)
    assert banned.token_ids != free.token_ids
    assert not any(ids[i:i + len(s)] == s for s in seqs for i in range(len(ids)))
    for extra, param in [({"allowed_token_ids": [10**7]}, "allowed_token_ids"),
                         ({"allowed_token_ids": list(range(5000))}, "allowed_token_ids"),
                         ({"bad_words": "the"}, "bad_words"), ({"bad_words": [""]}, "bad_words"),
                         ({"bad_words": ["x"], "guided_choice": ["a"]}, "bad_words")]:
        code, err = post(c, "/v1/completions", {"model": _model(c), "prompt": "x", "max_tokens": 2, **extra})
        assert code == 400 and err["error"]["param"] == param, err


def test_continue_final_message_echo_and_add_special_tokens(cluster, reference):
    """vLLM's prompt-shaping fields: a chat whose prompt ends inside the final assistant message,
    echoed before the continuation (whole and streamed), equal to the offline LLM.chat; a
    completion without the tokenizer's BOS; their misuses refused by name."""
    c = cluster(1)
    oa = client(c)
    msgs = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite is"}]
    extra = {"continue_final_message": True, "add_generation_prompt": False, "echo": True, "ignore_eos": True}
    from pdcluster import SamplingParams

    want = reference.llm.chat(msgs, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                              add_generation_prompt=False, continue_final_message=True)[0].outputs[0].text
    r = oa.chat.completions.create(model=_model(c), messages=msgs, max_tokens=6, temperature=0, extra_body=extra)
    assert r.choices[0].message.content == "My favourite is" + want
    chunks = list(oa.chat.completions.create(model=_model(c), messages=msgs, max_tokens=6, temperature=0,
                                             stream=True, extra_body=extra))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "My favourite is" + want
    code, body = post(c, "/tokenize", {"messages": msgs, "continue_final_message": True,
                                       "add_generation_prompt": False})
    tok = reference.llm.tokenizer
    assert code == 200 and body["tokens"] == tok.apply_chat_template(msgs, False, True, continue_final_message=True)
    assert tok.decode(body["tokens"]).endswith("My favourite is")
    # Echo of a chat that ends with the user's turn: nothing before the answer (vLLM's rule).
    r = oa.chat.completions.create(model=_model(c), messages=msgs[:1], max_tokens=3, temperature=0,
                                   extra_body={"echo": True, "ignore_eos": True})
    assert r.choices[0].message.content == reference.chat(msgs[:1], max_tokens=3).text
    # add_special_tokens=false on a completion: the prompt without BOS, one token fewer.
    bos = tok.encode("Hello there")[0]
    assert bos not in tok.encode("Hello there", add_special_tokens=False)
    r = oa.completions.create(model=_model(c), prompt="Hello there", max_tokens=3, temperature=0,
                              extra_body={"add_special_tokens": False, "ignore_eos": True})
    plain = tok.encode("Hello there", add_special_tokens=False)
    assert r.usage.prompt_tokens == len(plain) and r.choices[0].text == reference.generate(plain, max_tokens=3).text
    for path, body, param in [
            ("/v1/chat/completions", {"messages": msgs, "continue_final_message": True}, "continue_final_message"),
            ("/v1/chat/completions", {"messages": msgs[:1] + [{"role": "assistant", "content": " "}],
                                      "continue_final_message": True, "add_generation_prompt": False},
             "continue_final_message"),
            ("/v1/chat/completions", {"messages": msgs, "echo": True, "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, "echo"),
            ("/v1/completions", {"prompt": [5, 6], "add_special_tokens": True}, "add_special_tokens"),
            ("/v1/completions", {"prompt": "x", "add_special_tokens": "no"}, "add_special_tokens")]:
        code, err = post(c, path, {"model": _model(c), "max_tokens": 2, **body})
        assert code == 400 and err["error"]["param"] == param, (body, err)


def test_return_token_ids_and_request_id(cluster, reference):
    """vLLM's return_token_ids: the prompt's ids and each choice's output ids, whole and streamed
    (the streamed pieces add up to the whole); vLLM's request_id body field names the answer."""
    c = cluster(1)
    oa = client(c)
    tok = reference.llm.tokenizer
    want = list(reference.generate("Hello there", max_tokens=5).token_ids)
    code, body = post(c, "/v1/completions", {"model": _model(c), "prompt": "Hello there", "max_tokens": 5,
                                             "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                                             "request_id": "mine-1"})
    assert code == 200 and body["id"] == "cmpl-mine-1"
    assert body["choices"][0]["prompt_token_ids"] == tok.encode("Hello there")
    assert body["choices"][0]["token_ids"] == want
    chunks = list(oa.completions.create(model=_model(c), prompt="Hello there", max_tokens=5, temperature=0,
                                        stream=True, extra_body={"ignore_eos": True, "return_token_ids": True}))
    assert chunks[0].choices[0].prompt_token_ids == tok.encode("Hello there")
    assert [t for ch in chunks for t in ch.choices[0].token_ids] == want
    msgs = [{"role": "user", "content": "Hi"}]
    chat_ids = tok.apply_chat_template(msgs, True, True)
    want = list(reference.chat(msgs, max_tokens=4).token_ids)
    code, body = post(c, "/v1/chat/completions", {"model": _model(c), "messages": msgs, "max_tokens": 4,
                                                  "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    assert code == 200 and body["prompt_token_ids"] == chat_ids and body["choices"][0]["token_ids"] == want
    chunks = list(oa.chat.completions.create(model=_model(c), messages=msgs, max_tokens=4, temperature=0, stream=True,
                                             extra_body={"ignore_eos": True, "return_token_ids": True}))
    assert chunks[0].prompt_token_ids == chat_ids
    assert [t for ch in chunks[1:] for t in ch.choices[0].token_ids] == want
    code, body = post(c, "/v1/completions", {"model": _model(c), "prompt": "x", "max_tokens": 1})
    assert code == 200 and "token_ids" not in body["choices"][0]  # only when asked
    code, body = post(c, "/v1/completions", {"model": _model(c), "prompt": ["a b", "c"], "n": 2, "max_tokens": 3,
                                             "temperature": 1.0, "seed": 2, "ignore_eos": True,
                                             "return_token_ids": True})
    assert code == 200 and len(body["choices"]) == 4
    for ch in body["choices"]:  # each choice its own ids, each prompt its own
        assert len(ch["token_ids"]) == 3 and tok.decode(ch["token_ids"]) == ch["text"]
        assert ch["prompt_token_ids"] == tok.encode(["a b", "c"][ch["index"] // 2])
    # priority: 0 is every fcfs engine's; another value is refused by these (fcfs) workers by name.
    code, body = post(c, "/v1/completions", {"model": _model(c), "prompt": "x", "max_tokens": 1, "priority": 0})
    assert code == 200
    for bad, param in [({"return_token_ids": 1}, "return_token_ids"), ({"request_id": 7}, "request_id"),
                       ({"priority": 3}, "priority"), ({"priority": 2**40}, "priority"),
                       ({"request_id": "x" * 300}, "request_id")]:
        code, err = post(c, "/v1/completions", {"model": _model(c), "prompt": "x", "max_tokens": 1, **bad})
        assert code == 400 and err["error"]["param"] == param, err


def test_tokenize_and_detokenize(cluster):
    c = cluster(1)
    tok = c.router.preprocessor.tokenizer
    code, body = post(c, "/tokenize", {"prompt": "Hello world"})
    assert code == 200 and body["tokens"] == tok.encode("Hello world") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == c.router.preprocessor.max_model_len
    code, plain = post(c, "/tokenize", {"prompt": "Hello world", "add_special_tokens": False})
    assert code == 200 and plain["tokens"] == tok.encode("Hello world", add_special_tokens=False)
    code, chat = post(c, "/tokenize", {"messages": MSGS})
    assert code == 200 and chat["tokens"] == tok.apply_chat_template(MSGS, True, True)
    code, back = post(c, "/detokenize", {"tokens": plain["tokens"]})
    assert code == 200 and back["prompt"] == "Hello world"
    for path, bad, param in [("/tokenize", {"prompt": 5}, "prompt"), ("/tokenize", {"prompt": "x", "y": 1}, "y"),
                             ("/detokenize", {"tokens": [10**9]}, "tokens"),
                             ("/detokenize", {"tokens": [1], "model": "nope"}, "model")]:
        code, err = post(c, path, bad)
        assert code in (400, 404) and err["error"]["param"] == param, err
    with pytest.raises(openai.BadRequestError):
        client(c).completions.create(model=_model(c), prompt="x", max_tokens=2, extra_body={"nonsense": 1})


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                            "unit": {"type": "string", "enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


def _check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_tool_calls(cluster):
    c = cluster(1)
    oa = client(c)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r = oa.chat.completions.create(model=_model(c), messages=msgs, tools=TOOLS, max_tokens=80, temperature=0,
                                   tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    _check_calls(r.choices[0].message.tool_calls)
    assert [t.function.name for t in r.choices[0].message.tool_calls] == ["get_weather"]
    r = oa.chat.completions.create(model=_model(c), messages=msgs, tools=TOOLS, max_tokens=120, temperature=0.8,
                                   seed=1, tool_choice="required", parallel_tool_calls=False)
    assert r.choices[0].finish_reason == "tool_calls"
    _check_calls(r.choices[0].message.tool_calls)
    assert len(r.choices[0].message.tool_calls) == 1
    # Streamed: the client assembles the calls from the deltas.
    chunks = list(oa.chat.completions.create(model=_model(c), messages=msgs, tools=TOOLS, max_tokens=120,
                                             temperature=0, tool_choice="required", stream=True,
                                             parallel_tool_calls=False))  # one call: a bounded answer
    calls: dict[int, dict] = {}
    for ch in chunks:
        for tc in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
    assert calls and chunks[-1].choices[0].finish_reason == "tool_calls"
    for entry in calls.values():
        jsonschema.validate(json.loads(entry["arguments"]), SCHEMAS[entry["name"]])
    # A named function's arguments stream as fragments of one call.
    chunks = list(oa.chat.completions.create(model=_model(c), messages=msgs, tools=TOOLS, max_tokens=80,
                                             temperature=0, stream=True,
                                             tool_choice={"type": "function", "function": {"name": "get_time"}}))
    parts = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert len(parts) > 1 and parts[0].id.startswith("call_") and parts[0].function.name == "get_time"
    assert {tc.index for tc in parts} == {0} and chunks[-1].choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads("".join(tc.function.arguments or "" for tc in parts)), TIME)
    # auto: the model may answer in text; a multi-turn conversation with a tool result renders.
    history = msgs + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"}]
    r = oa.chat.completions.create(model=_model(c), messages=history, tools=TOOLS, max_tokens=5, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
    r = oa.chat.completions.create(model=_model(c), messages=msgs, tools=TOOLS, tool_choice="none", max_tokens=3,
                                   temperature=0)
    assert r.choices[0].message.tool_calls is None
    # Arguments are a JSON string inside the body, out of the body's depth check: a deep one is a
    # 400 naming messages (its depth bounded where the template gets it), never a 500.
    deep = [msgs[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "[" * 100_000}}]}]
    code, err = post(c, "/v1/chat/completions", {"model": _model(c), "messages": deep, "tools": TOOLS, "max_tokens": 1})
    assert code == 200 or (code == 400 and err["error"]["param"] == "messages"), err
    deeper = [msgs[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather",
                                                     "arguments": "[" * 500 + "]" * 500}}]}]
    code, err = post(c, "/v1/chat/completions", {"model": _model(c), "messages": deeper, "tools": TOOLS, "max_tokens": 1})
    assert code == 400 and err["error"]["param"] == "messages" and "deeper than the limit" in err["error"]["message"]


def test_hermes_tool_call_parsing():
    from pdcluster.router.openai_tools import ToolMode, extract_tool_calls

    mode = ToolMode("auto", ("get_weather",))
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "F"}}\n</tool_call>'
    content, calls = extract_tool_calls(text, mode)
    assert content == "Let me look." and len(calls) == 1
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome", "unit": "F"}'}
    assert extract_tool_calls("plain answer", mode) == ("plain answer", [])
    # Unknown functions and broken JSON stay text.
    assert extract_tool_calls('<tool_call>{"name": "rm", "arguments": {}}</tool_call>', mode)[1] == []
    assert extract_tool_calls("<tool_call>{nope}</tool_call>", mode)[1] == []


def test_n_siblings_reuse_the_prompts_blocks(cluster):
    """The siblings start after the first generation's first token: the prompt's full blocks are
    in the worker's prefix cache by then, so they are counted as cached prompt tokens."""
    c = cluster(1)
    prompt = list(range(5, 45))  # 40 tokens: two full blocks of 16
    r = client(c).completions.create(model=_model(c), prompt=prompt, max_tokens=2, n=3, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert len(r.choices) == 3
    assert r.usage.prompt_tokens == 40  # the prompt counted once
    assert r.usage.prompt_tokens_details.cached_tokens >= 2 * 32


def test_cache_salt_isolates_cached_prompts(cluster):
    """vLLM's cache_salt on completions and chat: a prompt cached under one salt is a hit for
    that salt only (usage's cached_tokens says so); a bad salt is a 400 naming the field."""
    c = cluster(1)
    oa = client(c)
    prompt = list(range(7, 57))  # 50 tokens: three full blocks of 16

    def cached(salt: str | None) -> int:
        extra = {"ignore_eos": True} | ({"cache_salt": salt} if salt is not None else {})
        r = oa.completions.create(model=_model(c), prompt=prompt, max_tokens=2, temperature=0, extra_body=extra)
        details = r.usage.prompt_tokens_details
        return details.cached_tokens if details else 0

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0 and cached(None) == 0
    assert cached("tenant-a") == 48 and cached("tenant-b") == 48 and cached(None) == 48
    msgs = [{"role": "user", "content": "a prompt long enough to fill a block or two of the cache " * 3}]
    first = oa.chat.completions.create(model=_model(c), messages=msgs, max_tokens=1, extra_body={"cache_salt": "c1"})
    again = oa.chat.completions.create(model=_model(c), messages=msgs, max_tokens=1, extra_body={"cache_salt": "c2"})
    assert first.usage.prompt_tokens > 32
    assert not (again.usage.prompt_tokens_details and again.usage.prompt_tokens_details.cached_tokens)
    for bad, words in ((5, "must be a string"), ("", "non-empty"), ("x" * 300, "at most 256")):
        for path, body in (("/v1/completions", {"prompt": [1, 2], "max_tokens": 1}),
                           ("/v1/chat/completions", {"messages": msgs, "max_tokens": 1})):
            code, err = post(c, path, {**body, "model": _model(c), "cache_salt": bad})
            assert code == 400 and err["error"]["param"] == "cache_salt" and words in err["error"]["message"], err


def test_truncate_prompt_tokens(cluster, reference):
    """vLLM's truncate_prompt_tokens on completions and chat: the prompt's last k tokens; a text
    far over the context is then encoded whole rather than refused from a prefix; echo shows what
    the model saw; with images it is refused by name (not here: text model)."""
    c = cluster(1)
    oa = client(c)
    tok = c.router.preprocessor.tokenizer
    limit = c.router.preprocessor.max_model_len
    text = "The quick brown fox jumps over the lazy dog. " * (limit // 4)
    ids = tok.encode(text)
    assert len(ids) > limit
    code, err = post(c, "/v1/completions", {"prompt": text, "max_tokens": 2})
    assert code == 400 and err["error"]["param"] == "prompt"
    r = oa.completions.create(model=_model(c), prompt=text, max_tokens=3, temperature=0,
                              extra_body={"ignore_eos": True, "truncate_prompt_tokens": 24})
    assert r.usage.prompt_tokens == 24
    assert r.choices[0].text == reference.generate(ids[-24:], max_tokens=3).text
    r = oa.completions.create(model=_model(c), prompt=text, max_tokens=3, temperature=0, echo=True,
                              extra_body={"ignore_eos": True, "truncate_prompt_tokens": -1})
    assert r.usage.prompt_tokens == limit - 3
    assert r.choices[0].text.startswith(tok.decode(ids[-(limit - 3):]))
    chat = oa.chat.completions.create(model=_model(c), messages=[{"role": "user", "content": text}], max_tokens=2,
                                      extra_body={"truncate_prompt_tokens": 40})
    assert chat.usage.prompt_tokens == 40
    for bad in (0, -5, "x", 1.5):
        code, err = post(c, "/v1/completions", {"prompt": "x", "truncate_prompt_tokens": bad})
        assert code == 400 and err["error"]["param"] == "truncate_prompt_tokens", err


def test_stream_options_continuous_usage_stats(cluster):
    """vLLM's stream_options.continuous_usage_stats: the running usage on every chunk, then the
    final usage chunk; an unknown stream_options field is refused by name, never ignored."""
    c = cluster(1)
    for path, body in (("/v1/completions", {"prompt": [5, 6, 7]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        host, port = c.http_url.removeprefix("http://").rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("POST", path, body=json.dumps({
            **body, "model": _model(c), "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"continuous_usage_stats": True}}).encode(), headers={"Content-Type": "application/json"})
        lines = conn.getresponse().read().decode().splitlines()
        conn.close()
        chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        with_choices = [ch for ch in chunks if ch["choices"]]
        counts = [ch["usage"]["completion_tokens"] for ch in with_choices]
        assert counts == sorted(counts) and counts[-1] == 5, counts
        assert all(ch["usage"]["prompt_tokens"] > 0 for ch in with_choices)
        assert not chunks[-1]["choices"] and chunks[-1]["usage"]["completion_tokens"] == 5
        code, err = post(c, path, {**body, "stream": True, "stream_options": {"include_usage": True, "extra": 1}})
        assert code == 400 and err["error"]["param"] == "stream_options" and "extra" in err["error"]["message"]
