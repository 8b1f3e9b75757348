"""vLLM's --chat-template: a template file (or the text) replaces the model's own, on `serve`,
`router` and `up` (and the YAML's router.chat_template); a missing file or a template that does
not compile is refused before anything starts, naming the flag. The router renders chats with it
(HTTP chat, /tokenize, the Responses API)."""

from __future__ import annotations

import argparse
import json

import pytest
from test_openai_features import post

from pdcluster.cluster.config import ConfigError
from pdcluster.cluster.router_cmd import check_router_flags
from pdcluster.cluster.up_cmd import add_up_commands, build_config
from pdcluster.engine.tokenizer import MAX_CHAT_TEMPLATE_BYTES, load_chat_template
from pdcluster.router.config import RouterConfig

TEMPLATE = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")
MSGS = [{"role": "system", "content": "Be short."}, {"role": "user", "content": "Hello there"}]


def test_load_reads_a_file_or_takes_the_text(tmp_path) -> None:
    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE)
    assert load_chat_template(str(f)) == TEMPLATE
    assert load_chat_template(TEMPLATE) == TEMPLATE
    with pytest.raises(ValueError, match="no such file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not compile"):
        load_chat_template("{% for m in messages %}{{ m.content ")
    big = tmp_path / "big.jinja"
    big.write_text("{{ x }}" + " " * MAX_CHAT_TEMPLATE_BYTES)
    with pytest.raises(ValueError, match="larger than"):
        load_chat_template(str(big))


def test_serve_and_router_check_it_before_anything_starts(tmp_path) -> None:
    args = argparse.Namespace(host="127.0.0.1", tls_cert=None, insecure=False, api_key=None,
                              chat_template=str(tmp_path / "nope.jinja"), grpc_port=0, http_port=0,
                              tool_call_parser="hermes", generation_config="auto")
    with pytest.raises(ValueError, match="--chat-template"):
        check_router_flags(args)
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    args.chat_template = str(tmp_path / "t.jinja")
    check_router_flags(args)
    assert args.chat_template == TEMPLATE  # the text travels on, not the path


def test_up_flag_and_yaml_reach_the_router_spec(tmp_path) -> None:
    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE)
    sub = argparse.ArgumentParser().add_subparsers()
    add_up_commands(sub)
    config = build_config(sub.choices["up"].parse_args(["--workers", "1", "--chat-template", str(f)]))
    assert config.router.chat_template == TEMPLATE
    assert RouterConfig(workers=("127.0.0.1:1",), chat_template=config.router.chat_template).chat_template == TEMPLATE
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text(json.dumps({"router": {"chat_template": str(tmp_path / "missing.jinja")}}))
    with pytest.raises(ConfigError, match="router.chat_template"):
        build_config(sub.choices["up"].parse_args(["--workers", "1", "--config", str(yaml_file)]))


def test_the_router_renders_chats_with_it(cluster, reference) -> None:
    c = cluster(1, chat_template=TEMPLATE)
    tok = c.router.preprocessor.tokenizer
    rendered = "[system] Be short.\n[user] Hello there\n[assistant] "
    code, body = post(c, "/tokenize", {"messages": MSGS})
    assert code == 200 and body["tokens"] == tok.encode(rendered, add_special_tokens=False)
    want = reference.generate(tok.encode(rendered, add_special_tokens=False), max_tokens=4)
    code, body = post(c, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 4, "temperature": 0,
                                                  "ignore_eos": True})
    assert code == 200 and body["choices"][0]["message"]["content"] == want.text
    code, body = post(c, "/v1/responses", {"instructions": "Be short.", "input": "Hello there", "max_output_tokens": 4,
                                           "temperature": 0, "ignore_eos": True})
    assert code == 200 and body["output"][0]["content"][0]["text"] == want.text


THINKING = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% if enable_thinking is defined and not enable_thinking %}"
            " <no-think>{% endif %} {% endif %}")


def test_chat_template_kwargs(cluster, reference) -> None:
    """vLLM's chat_template_kwargs (Qwen3's enable_thinking is the common one): extra template
    variables on chat and /tokenize, over HTTP and gRPC; names the server sets, non-objects, too
    many names and JSON deeper than the limit are refused naming the field."""
    import grpc

    from pdcluster._proto import common_pb2, router_pb2

    c = cluster(1, chat_template=THINKING)
    tok = c.router.preprocessor.tokenizer
    plain = "[system] Be short.\n[user] Hello there\n[assistant] "
    off = "[system] Be short.\n[user] Hello there\n[assistant] <no-think> "
    for kwargs, text in (({}, plain), ({"enable_thinking": True}, plain), ({"enable_thinking": False}, off)):
        code, body = post(c, "/tokenize", {"messages": MSGS, "chat_template_kwargs": kwargs})
        assert code == 200 and body["tokens"] == tok.encode(text, add_special_tokens=False), kwargs
    want = reference.generate(tok.encode(off, add_special_tokens=False), max_tokens=4)
    code, body = post(c, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                                                  "chat_template_kwargs": {"enable_thinking": False}})
    assert code == 200 and body["choices"][0]["message"]["content"] == want.text
    assert body["usage"]["prompt_tokens"] == len(tok.encode(off, add_special_tokens=False))
    bad = [(5, "JSON object"), ({"messages": []}, "set by the server"), ({"tools": 1}, "set by the server"),
           ({"add_generation_prompt": False}, "set by the server"), ({"eos_token": "x"}, "set by the server"),
           ({"not a name": 1}, "not a template variable"),
           ({f"v{i}": i for i in range(33)}, "at most 32")]
    for kwargs, words in bad:
        code, err = post(c, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 1, "chat_template_kwargs": kwargs})
        assert code == 400 and err["error"]["param"] == "chat_template_kwargs" and words in err["error"]["message"], err
    # gRPC carries JSON text: nesting past the limit is refused by name, for the tools' JSON too.
    deep = "[" * 5000 + "]" * 5000
    for field, name in (("template_kwargs_json", "chat_template_kwargs"), ("tools_json", "tools")):
        chat = router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role="user", content="hi")],
                                       add_generation_prompt=True, **{field: deep})
        req = router_pb2.GenerateRequest(chat=chat, sampling_params=common_pb2.SamplingParams(max_tokens=1))
        with pytest.raises(grpc.RpcError) as e:
            list(c.stub.Generate(req, timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith(name) and "deeper than the limit of 32" in e.value.details()
    assert post(c, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 1})[0] == 200


REASONING_TEMPLATE = ("{% for m in messages %}[{{ m.role }}]{% if m.reasoning_content is defined %}"
                      "<think>{{ m.reasoning_content }}</think>{% endif %} {{ m.content }}\n{% endfor %}")


def test_history_message_keys(cluster) -> None:
    """An earlier answer's thought (`reasoning` / `reasoning_content`) reaches the template as
    reasoning_content; the empty keys OpenAI's SDK writes into a message are taken; any other key
    is refused by name, never ignored."""
    c = cluster(1, chat_template=REASONING_TEMPLATE)
    tok = c.router.preprocessor.tokenizer
    for keys in ({"reasoning": "add them"}, {"reasoning_content": "add them"},
                 {"reasoning_content": None, "reasoning": "add them"}):
        history = [{"role": "user", "content": "2+2?"},
                   {"role": "assistant", "content": "4", **keys, "refusal": None, "annotations": [],
                    "audio": None, "function_call": None, "tool_calls": None},
                   {"role": "user", "content": "and 3+3?"}]
        code, body = post(c, "/tokenize", {"messages": history, "add_generation_prompt": False})
        want = "[user] 2+2?\n[assistant]<think>add them</think> 4\n[user] and 3+3?\n"
        assert code == 200 and body["tokens"] == tok.encode(want, add_special_tokens=False), keys
    bad = [({"role": "user", "content": "x", "weight": 2}, "messages[0].weight is not supported"),
           ({"role": "user", "content": "x", "refusal": "no"}, "messages[0].refusal is not supported"),
           ({"role": "user", "content": "x", "reasoning": "hm"}, "only an assistant message"),
           ({"role": "assistant", "content": "x", "reasoning": 5}, "must be a string")]
    for message, words in bad:
        code, err = post(c, "/v1/chat/completions", {"messages": [message], "max_tokens": 1})
        assert code == 400 and err["error"]["param"] == "messages" and words in err["error"]["message"], err
