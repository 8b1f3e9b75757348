"""vLLM's --tool-call-parser: each format read into calls (pure, milliseconds), what is not a call
left as content, literal-only pythonic arguments, plugins by dotted path; and through a served
router, where a regex grammar makes the demo model write the format, so the answer's tool_calls
come from a real generation."""

from __future__ import annotations

import json

import openai
import pytest

from pdcluster.router.config import RouterConfig
from pdcluster.router.openai_tools import ToolMode, extract_tool_calls
from pdcluster.router.tool_parsers import TOOL_CALL_PARSERS, hermes, llama3_json, mistral, pythonic
from pdcluster.router.tool_stream import ToolCallStream, streams

NAMES = ("get_weather", "get_time")


def test_hermes():
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    assert hermes(text, NAMES) == ("Let me look.", [("get_weather", {"city": "Rome"})])
    assert hermes("no calls", NAMES) == ("no calls", [])


def test_llama3_json():
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "get_time", "parameters": {}}'
    assert llama3_json(text, NAMES) == (None, [("get_weather", {"city": "Rome"}), ("get_time", {})])
    assert llama3_json('{"name": "get_time", "arguments": {"tz": "UTC"}} done', NAMES) == (
        "done", [("get_time", {"tz": "UTC"})])
    for plain in ('{"name": "rm", "parameters": {}}', '{"city": 1}', "The answer is {x}", '{"name": "get_time"', ""):
        assert llama3_json(plain, NAMES) == (plain, [])


def test_mistral():
    text = 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "nope", "arguments": {}}]'
    assert mistral(text, NAMES) == ("Sure.", [("get_weather", {"city": "Oslo"})])
    # skip_special_tokens took the marker out: the list alone is read.
    assert mistral('[{"name": "get_time", "arguments": {}}]', NAMES) == (None, [("get_time", {})])
    for plain in ("[1, 2]", "plain", "[TOOL_CALLS] not json", '[{"name": "x"}]'):
        assert mistral(plain, NAMES) == (plain, [])


def test_pythonic_reads_literals_and_never_evaluates():
    text = '[get_weather(city="Rome", days=3, hourly=True, tags=["a", None]), get_time()]'
    content, calls = pythonic(text, NAMES)
    assert content is None and [(n, json.loads(a)) for n, a in calls] == [
        ("get_weather", {"city": "Rome", "days": 3, "hourly": True, "tags": ["a", None]}), ("get_time", {})]
    assert pythonic("<|python_start|>[get_time(tz='UTC')]<|python_end|>", NAMES)[1] == [("get_time", '{"tz": "UTC"}')]
    for plain in ['[get_weather(city=__import__("os").system("id"))]',  # not a literal: never run
                  "[get_weather('Rome')]",  # positional
                  "[get_weather(**kw)]", "[os.system(x)]", "[rm()]", "[get_time(tz=b'x')]",  # bytes: no JSON
                  "[get_time(tz={1, 2})]", "[get_time(n=1e999)]", "get_time()", "[" * 500 + "]" * 500,
                  "[get_time(tz=" + "[" * 400 + "]" * 400 + ")]", "plain"]:
        assert pythonic(plain, NAMES) == (plain, []), plain


def test_auto_mode_uses_the_configured_parser_and_plugins_resolve():
    mode = ToolMode("auto", NAMES, parser="llama3_json")
    content, calls = extract_tool_calls('{"name": "get_time", "parameters": {"tz": "UTC"}}', mode)
    assert content is None and calls[0]["function"] == {"name": "get_time", "arguments": '{"tz": "UTC"}'}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    assert TOOL_CALL_PARSERS.get("tests.router.test_tool_parsers:upper_parser") is upper_parser
    assert RouterConfig(tool_call_parser="tests.router.test_tool_parsers:upper_parser").tool_call_parser
    with pytest.raises(ValueError, match="tool_call_parser: unknown tool call parser 'nope'; available: hermes, "
                                         "llama3_json, mistral, pythonic"):
        RouterConfig(tool_call_parser="nope")
    with pytest.raises(ValueError, match="refused"):
        RouterConfig(tool_call_parser="tests.router.test_tool_parsers:NAMES")


HERMES_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
STREAMED = [  # parser, answer, the content sent before the last chunk
    ("hermes", "Let me look it up. " + HERMES_CALL, "Let me look it up."),
    ("hermes", "Two calls:\n" + HERMES_CALL + HERMES_CALL, "Two calls:"),
    ("hermes", "A <tool_call>that is not JSON</tool_call> stays text", "A"),
    ("hermes", "plain text, no call at all", "plain text, no call at all"),
    ("hermes", "   leading spaces, then words", "   leading spaces, then words"),
    ("hermes", "  text\n" + HERMES_CALL, "  text"),  # the whole answer's content is "text": see below
    ("hermes", "ends on a partial marker <tool_c", "ends on a partial marker"),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "get_time", "arguments": {}}]', "Sure."),
    ("mistral", '[{"name": "get_time", "arguments": {}}]', ""),
    ("mistral", "[1, 2] is a list, not a call", ""),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {}}', ""),
    ("llama3_json", '{"name": "nope", "parameters": {}}', ""),
    ("llama3_json", "An answer in words.", "An answer in words."),
    ("pythonic", '[get_weather(city="Paris")]', ""),
    ("pythonic", "No call here.", "No call here."),
]


@pytest.mark.parametrize(("parser", "answer", "early"), STREAMED)
@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_a_streamed_answer_sends_its_content_early_and_ends_as_the_whole_answer(parser, answer, early, piece):
    """Fed in pieces, the stream sends the text before any possible call at once, never a byte a
    call may own; its content and calls at the end are the whole answer's parse."""
    mode = ToolMode("auto", NAMES, parser=parser)
    want_content, want_calls = extract_tool_calls(answer, mode)
    ts = ToolCallStream(mode)
    sent = "".join(ts.feed(answer[i:i + piece]) for i in range(0, len(answer), piece))
    assert sent == early
    tail, calls = ts.finish()
    got = (sent + (tail or "")) or None
    if answer.startswith(" ") and want_calls:  # the one documented difference: leading whitespace
        assert got is not None and got.lstrip() == want_content
    else:
        assert got == want_content
    assert [c["function"] for c in calls] == [c["function"] for c in want_calls]


def test_only_auto_with_a_built_in_parser_streams():
    assert streams(ToolMode("auto", NAMES, parser="hermes"))
    assert not streams(ToolMode("auto", NAMES, parser="tests.router.test_tool_parsers:upper_parser"))
    assert not streams(ToolMode("required", NAMES)) and not streams(ToolMode("named", NAMES, name="get_time"))
    assert not streams(None)
    with pytest.raises(ValueError, match="does not stream"):
        ToolCallStream(ToolMode("required", NAMES))


def upper_parser(text, names):  # a plugin: every answer is one call of the first function
    return None, [(names[0], {"said": text.upper()})]


WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
FORCED = {  # parser -> (a regex that makes the model write one call in that format, the call, the content)
    "llama3_json": (r'\{"name": "get_weather", "parameters": \{"city": "Rome"\}\}', {"city": "Rome"}, None),
    "mistral": (r'\[\{"name": "get_weather", "arguments": \{"city": "Oslo"\}\}\]', {"city": "Oslo"}, None),
    "pythonic": (r'\[get_weather\(city="Paris"\)\]', {"city": "Paris"}, None),
    "hermes": (r'Looking it up for you\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "Bern"\}\}'
               r'</tool_call>', {"city": "Bern"}, "Looking it up for you."),
}


@pytest.mark.parametrize("parser", sorted(FORCED))
def test_served_answers_carry_the_parsed_calls(cluster, parser):
    c = cluster(1, tool_call_parser=parser)
    oa = openai.OpenAI(base_url=c.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    regex, args, content = FORCED[parser]
    ask = {"model": c.router.preprocessor.model_name, "tools": WEATHER, "max_tokens": 160, "temperature": 0,
           "messages": [{"role": "user", "content": "Weather?"}], "extra_body": {"structured_outputs": {"regex": regex}}}
    r = oa.chat.completions.create(**ask)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == args
    # Streamed: the content before the call arrives in chunks of its own, the call with the last one.
    chunks = [ch for ch in oa.chat.completions.create(**ask, stream=True) if ch.choices]
    texts = [ch.choices[0].delta.content for ch in chunks[:-1] if ch.choices[0].delta.content]
    assert ("".join(texts) or None) == content and (content is None or len(texts) > 1), texts
    (streamed,) = chunks[-1].choices[0].delta.tool_calls
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and json.loads(streamed.function.arguments) == args


def test_flags_and_yaml_are_checked_before_anything_starts():
    from pdcluster.cluster.cli import build_parser
    from pdcluster.cluster.config import ClusterConfig, ConfigError
    from pdcluster.cluster.router_cmd import check_router_flags
    from pdcluster.cluster.up_cmd import build_config

    args = build_parser().parse_args(["serve", "--tool-call-parser", "nope", "--enable-auto-tool-choice",
                                      "--http-port", "0", "--grpc-port", "0"])
    with pytest.raises(ValueError, match="--tool-call-parser: unknown tool call parser 'nope'"):
        check_router_flags(args)
    up = build_parser().parse_args(["up", "--workers", "1", "--tool-call-parser", "pythonic", "--enable-auto-tool-choice"])
    assert build_config(up).router.tool_call_parser == "pythonic"
    with pytest.raises(ConfigError, match="router.tool_call_parser: --tool-call-parser: unknown tool call parser"):
        ClusterConfig.from_dict({"router": {"tool_call_parser": "nope"}})
