"""--reasoning-parser through a real router and worker (demo model): chat whole and streamed, the
Responses API's reasoning item, include_reasoning, and no split under structured output. The demo
model never writes `</think>`, so under deepseek_r1 (which starts in the thought) its whole answer
is the thought and under qwen3 (which needs `<think>` first) its whole answer is the content; the
split itself is tested piece by piece in test_reasoning.py."""

from __future__ import annotations

import json

import openai

MSGS = [{"role": "user", "content": "Say something about lists."}]
GREEDY = {"max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}


def _client(c) -> openai.OpenAI:
    return openai.OpenAI(base_url=c.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _model(c) -> str:
    return c.router.preprocessor.model_name


def test_deepseek_r1_chat_and_responses(cluster, reference):
    c = cluster(1, reasoning_parser="deepseek_r1")
    oa = _client(c)
    want = reference.chat(MSGS, max_tokens=12).text
    r = oa.chat.completions.create(model=_model(c), messages=MSGS, **GREEDY)
    message = r.choices[0].message.model_dump()
    assert message["reasoning"] == want and message["content"] == ""
    chunks = list(oa.chat.completions.create(model=_model(c), messages=MSGS, stream=True, **GREEDY))
    deltas = [ch.choices[0].delta.model_dump() for ch in chunks if ch.choices]
    assert "".join(d.get("reasoning") or "" for d in deltas) == want
    assert "".join(d.get("content") or "" for d in deltas) == ""
    hidden = oa.chat.completions.create(model=_model(c), messages=MSGS, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True, "include_reasoning": False})
    assert hidden.choices[0].message.model_dump()["reasoning"] is None
    # A grammar shapes the output from its first token: there is no thought to split off.
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object", "properties": {
        "x": {"type": "integer"}}, "required": ["x"], "additionalProperties": False}}}
    r = oa.chat.completions.create(model=_model(c), messages=MSGS, response_format=fmt, max_tokens=30, temperature=0)
    assert "x" in json.loads(r.choices[0].message.content)
    assert "reasoning" not in r.choices[0].message.model_dump() or r.choices[0].message.model_dump()["reasoning"] is None
    # The Responses API: a reasoning item before the message, whole and streamed.
    resp = oa.responses.create(model=_model(c), input="Say something about lists.", max_output_tokens=12, temperature=0,
                               extra_body={"ignore_eos": True})
    kinds = [item.type for item in resp.output]
    assert kinds == ["reasoning", "message"]
    assert resp.output[0].content[0].text == want
    events = list(oa.responses.create(model=_model(c), input="Say something about lists.", max_output_tokens=12,
                                      temperature=0, stream=True, extra_body={"ignore_eos": True}))
    done = events[-1].response  # max_output_tokens ends it: response.incomplete
    assert events[-1].type == "response.incomplete"
    assert [item.type for item in done.output] == ["reasoning", "message"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == want
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_qwen3_leaves_an_answer_without_a_thought_alone(cluster, reference):
    c = cluster(1, reasoning_parser="qwen3")
    want = reference.chat(MSGS, max_tokens=12).text
    r = _client(c).chat.completions.create(model=_model(c), messages=MSGS, **GREEDY)
    message = r.choices[0].message.model_dump()
    assert message["content"] == want and message["reasoning"] is None


def test_the_flag_reaches_every_router(tmp_path):
    """serve/router's --reasoning-parser and up's flag and YAML router.reasoning_parser; an unknown
    name is refused by name (argparse's choices, the YAML check, RouterConfig)."""
    import argparse

    import pytest

    from pdcluster.cluster.cli import build_parser
    from pdcluster.cluster.config import ConfigError
    from pdcluster.cluster.router_cmd import REASONING_PARSER_NAMES
    from pdcluster.cluster.up_cmd import add_up_commands, build_config
    from pdcluster.router.config import RouterConfig
    from pdcluster.router.reasoning import REASONING_PARSERS

    assert sorted(REASONING_PARSER_NAMES) == sorted(REASONING_PARSERS)  # the CLI's import-free copy
    assert build_parser().parse_args(["serve", "--reasoning-parser", "qwen3"]).reasoning_parser == "qwen3"
    sub = argparse.ArgumentParser().add_subparsers()
    add_up_commands(sub)
    config = build_config(sub.choices["up"].parse_args(["--workers", "1", "--reasoning-parser", "deepseek_r1"]))
    assert config.router.reasoning_parser == "deepseek_r1"
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text(json.dumps({"router": {"reasoning_parser": "o1"}}))
    with pytest.raises(ConfigError, match="router.reasoning_parser: 'o1'"):
        build_config(sub.choices["up"].parse_args(["--workers", "1", "--config", str(yaml_file)]))
    with pytest.raises(ValueError, match="--reasoning-parser 'o1'"):
        RouterConfig(reasoning_parser="o1")
