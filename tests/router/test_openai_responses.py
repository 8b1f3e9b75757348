"""OpenAI's Responses API (POST /v1/responses) through the router's HTTP frontend, driven by the
official `openai` client against real `serve-worker` processes (demo model, CPU): text equal to the
offline engine's chat output, the typed stream events, logprobs, structured output, function tools
and tool history, and what is not served refused by name. The translation itself (input items ->
chat messages, refusals renamed into the client's terms) is tested without a cluster at the end."""

from __future__ import annotations

import json

import jsonschema
import pytest
from test_openai_features import SCHEMA, SCHEMAS, TIME, WEATHER, _model, client, post

from pdcluster.router.errors import RouterError, invalid
from pdcluster.router.responses_api import parse_responses, rename_error

TOOLS = [{"type": "function", "name": "get_weather", "description": "weather", "parameters": WEATHER},
         {"type": "function", "name": "get_time", "parameters": TIME}]
SYSTEM = "You answer briefly."
QUESTION = "Which city is the capital of France?"


def test_text_equals_the_offline_chat_and_streams_typed_events(cluster, reference):
    c = cluster(1)
    oa = client(c)
    want = reference.chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
                          max_tokens=6)
    r = oa.responses.create(model=_model(c), instructions=SYSTEM, input=QUESTION, max_output_tokens=6,
                            temperature=0, extra_body={"ignore_eos": True}, metadata={"k": "v"})
    assert r.output_text == want.text and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 6 and r.usage.total_tokens == r.usage.input_tokens + 6
    assert r.id.startswith("resp_") and r.store is True and r.metadata == {"k": "v"} and r.instructions == SYSTEM
    assert oa.responses.retrieve(r.id).output_text == r.output_text  # stored: OpenAI's default
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "incomplete"

    # Streamed: created, in_progress, the item and its part, one delta per token, then the close.
    with oa.responses.stream(model=_model(c), instructions=SYSTEM, input=QUESTION, max_output_tokens=6,
                             temperature=0, extra_body={"ignore_eos": True}) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[4:-4] == ["response.output_text.delta"] * 6
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want.text
    assert events[-1].response.output_text == want.text and events[-1].response.usage.output_tokens == 6
    assert len({e.item_id for e in events if hasattr(e, "item_id")}) == 1

    # A stop string ends it as completed: the SDK's final response is there.
    want = reference.chat([{"role": "user", "content": QUESTION}], max_tokens=60, stop=["."])
    with oa.responses.stream(model=_model(c), input=[{"role": "user", "content": [{"type": "input_text",
                                                                                    "text": QUESTION}]}],
                             max_output_tokens=60, temperature=0, extra_body={"ignore_eos": True, "stop": ["."]}
                             ) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == want.text
    assert final.incomplete_details is None


def test_logprobs_match_the_offline_engine(cluster, reference):
    c = cluster(1)
    oa = client(c)
    msgs = [{"role": "user", "content": QUESTION}]
    want = reference.chat(msgs, max_tokens=3, logprobs=2)
    r = oa.responses.create(model=_model(c), input=QUESTION, max_output_tokens=3, temperature=0,
                            include=["message.output_text.logprobs"], top_logprobs=2,
                            extra_body={"ignore_eos": True})
    entries = r.output[0].content[0].logprobs
    assert len(entries) == 3
    for got, w in zip(entries, want.logprobs):
        assert got.logprob == pytest.approx(w.sampled.logprob, abs=1e-4)
        assert [t.logprob for t in got.top_logprobs] == pytest.approx([t.logprob for t in w.top], abs=1e-4)


def test_structured_output_and_function_tools(cluster):
    c = cluster(1)
    oa = client(c)
    r = oa.responses.create(model=_model(c), input="Which city? Answer in JSON.", max_output_tokens=60, temperature=0,
                            text={"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA,
                                             "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), SCHEMA)

    # A named function: its arguments are the whole output, one function_call item.
    r = oa.responses.create(model=_model(c), input="Weather in Paris?", tools=TOOLS, max_output_tokens=80,
                            temperature=0, tool_choice={"type": "function", "name": "get_weather"})
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)

    # Required, streamed: the calls arrive as items with their arguments.
    with oa.responses.stream(model=_model(c), input="Weather in Paris?", tools=TOOLS, tool_choice="required",
                             parallel_tool_calls=False, max_output_tokens=120, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    calls = [o for o in final.output if o.type == "function_call"]
    assert len(calls) == 1 and "response.function_call_arguments.done" in [e.type for e in events]
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS[calls[0].name])

    # A history with a call and its output renders as the same chat conversation does.
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                "arguments": '{"city": "Paris", "unit": "C"}'},
               {"type": "function_call_output", "call_id": "call_1", "output": "21 C, sunny"}]
    r = oa.responses.create(model=_model(c), input=history, tools=TOOLS, tool_choice="none", max_output_tokens=5,
                            temperature=0, extra_body={"ignore_eos": True})
    chat_tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
    chat = oa.chat.completions.create(model=_model(c), tools=chat_tools, tool_choice="none", max_tokens=5,
                                      temperature=0, extra_body={"ignore_eos": True}, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"}])
    assert r.output_text == chat.choices[0].message.content


REFUSED = [({"store": "yes"}, "store"),
           ({"previous_response_id": "resp_1"}, "previous_response_id"),  # kept by no one
           ({"previous_response_id": 7}, "previous_response_id"),
           ({"background": True}, "background"),
           ({"truncation": "auto"}, "truncation"),
           ({"reasoning": {"effort": "high"}}, "reasoning"),
           ({"tools": [{"type": "web_search"}]}, "tools"),
           ({"include": ["file_search_call.results"]}, "include"),
           ({"top_logprobs": 2}, "top_logprobs"),
           ({"max_output_tokens": 0}, "max_output_tokens"),
           ({"max_output_tokens": 10**6}, "max_output_tokens"),  # past the context: the Preprocessor's check
           ({"text": {"format": {"type": "xml"}}}, "text.format"),
           ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}}}, "text.format"),
           ({"text": {"verbosity": "low"}}, "text.verbosity"),
           ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
           ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
           ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input"),
           ({"input": []}, "input"),
           ({"conversation": "conv_1"}, "conversation"),
           ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
           ({"temperature": "hot"}, "temperature")]


@pytest.mark.parametrize("extra,param", REFUSED, ids=[p + str(i) for i, (_, p) in enumerate(REFUSED)])
def test_what_is_not_served_is_refused_by_name(cluster, extra, param):
    c = cluster(1)
    code, err = post(c, "/v1/responses", {"input": "hi", "max_output_tokens": 4, **extra})
    assert code == 400 and err["error"]["param"] == param, err
    assert post(c, "/v1/responses", {"input": "hi", "max_output_tokens": 2})[0] == 200  # serving on


def test_previous_response_id_continues_a_stored_conversation(cluster, reference):
    """A stored answer's conversation (its input and output) comes before the next input, after the
    new request's own instructions; streamed answers are stored too; store=false and a deleted
    response are not found; with the store off, store and previous_response_id are refused."""
    c = cluster(1)
    oa = client(c)
    first = oa.responses.create(model=_model(c), input=QUESTION, max_output_tokens=5, temperature=0,
                                extra_body={"ignore_eos": True})
    follow = "And Italy?"
    history = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": first.output_text}]
    want = reference.chat([{"role": "system", "content": SYSTEM}, *history, {"role": "user", "content": follow}],
                          max_tokens=5)
    second = oa.responses.create(model=_model(c), previous_response_id=first.id, instructions=SYSTEM, input=follow,
                                 max_output_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert second.output_text == want.text and second.previous_response_id == first.id
    third_want = reference.chat([*history, {"role": "user", "content": follow},
                                 {"role": "assistant", "content": second.output_text},
                                 {"role": "user", "content": "Why?"}], max_tokens=4)
    with oa.responses.stream(model=_model(c), previous_response_id=second.id, input="Why?", max_output_tokens=4,
                             temperature=0, extra_body={"ignore_eos": True}) as stream:
        third = [ev for ev in stream][-1].response  # response.incomplete: the token limit
    assert third.output_text == third_want.text and oa.responses.retrieve(third.id).output_text == third.output_text
    # What the second answer was generated from: the first turn, then its own input, newest first.
    items = oa.responses.input_items.list(second.id)
    assert [(it.type, it.role, it.content[0].text) for it in items.data] == [
        ("message", "user", follow), ("message", "assistant", first.output_text), ("message", "user", QUESTION)]
    code, page = urllib_get(c, f"/v1/responses/{second.id}/input_items?order=asc&limit=2")
    assert code == 200 and page["has_more"] and [it["content"][0]["type"] for it in page["data"]] == [
        "input_text", "output_text"]
    code, rest = urllib_get(c, f"/v1/responses/{second.id}/input_items?order=asc&after={page['last_id']}")
    assert code == 200 and not rest["has_more"] and rest["data"][0]["id"] == items.data[0].id
    for query, param in [("limit=0", "limit"), ("limit=%C2%B2", "limit"), ("order=up", "order"), ("after=msg_x", "after"), ("include=x", "include")]:
        code, err = urllib_get(c, f"/v1/responses/{second.id}/input_items?{query}")
        assert code == 400 and err["error"]["param"] == param, err
    assert urllib_get(c, "/v1/responses/resp_nope/input_items")[0] == 404
    code, err = post(c, "/v1/responses", {"input": "hi", "max_output_tokens": 2, "store": False})
    assert code == 200 and err["store"] is False
    assert urllib_get(c, "/v1/responses/" + err["id"])[0] == 404
    deleted = urllib_request(c, "DELETE", "/v1/responses/" + first.id)
    assert deleted == (200, {"id": first.id, "object": "response", "deleted": True})
    code, err = post(c, "/v1/responses", {"input": "x", "previous_response_id": first.id})
    assert code == 400 and err["error"]["param"] == "previous_response_id"
    off = cluster(1, responses_store_bytes=0)
    for extra, param in [({"store": True}, "store"), ({"previous_response_id": second.id}, "previous_response_id")]:
        code, err = post(off, "/v1/responses", {"input": "hi", "max_output_tokens": 2, **extra})
        assert code == 400 and err["error"]["param"] == param, err
    code, body = post(off, "/v1/responses", {"input": "hi", "max_output_tokens": 2})
    assert code == 200 and body["store"] is False


def urllib_request(c, method: str, path: str) -> tuple[int, dict]:
    import http.client

    host, port = c.http_url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request(method, path)
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    return resp.status, json.loads(raw) if raw else {}


def urllib_get(c, path: str) -> tuple[int, dict]:
    return urllib_request(c, "GET", path)


def test_the_store_is_bounded_by_bytes_least_recently_used_first():
    from pdcluster.router.response_store import ResponseStore, output_as_input

    store = ResponseStore(max_bytes=8000)
    for i in range(6):
        assert store.put({"id": f"r{i}", "text": "x" * 600}, [{"role": "user", "content": "y" * 400}])
    assert store.get("r0") is None and store.get("r5") is not None and store.nbytes <= 8000
    store.get("r1")  # used: kept over r2, now the least recently used, at the next eviction
    store.put({"id": "r6", "text": "x" * 600}, [])
    assert store.get("r1") is not None and store.get("r2") is None
    assert not store.put({"id": "big", "text": "x" * 3000}, [])  # over a quarter of the budget: not kept
    assert not ResponseStore(0).put({"id": "r", "text": ""}, [])
    assert store.delete("r3") and not store.delete("r3")
    out = [{"type": "reasoning", "content": []}, {"type": "message", "content": [{"type": "output_text", "text": "hi"}]},
           {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "f", "arguments": "{}", "status": "x"}]
    assert output_as_input(out) == [
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hi"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}]
    thought = {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "hmm"}]}
    assert output_as_input([thought, out[1]])[0] == thought  # replayed with the turn it led to
    assert output_as_input([thought]) == []  # nothing after it: not replayed


def test_reasoning_items_reach_the_assistant_turn_after_them():
    thought = {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "think"}]}
    req, _, _ = parse_responses({"input": [{"role": "user", "content": "q"}, thought,
                                           {"role": "assistant", "content": "a"},
                                           {"role": "user", "content": "more"}]}, "m")
    assert [(m.role, m.reasoning_content) for m in req.chat.messages] == [("user", ""), ("assistant", "think"),
                                                                          ("user", "")]
    req, _, _ = parse_responses({"input": [{"role": "user", "content": "q"},
                                           {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}]},
                                           {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                                           {"type": "function_call_output", "call_id": "c", "output": "1"}]}, "m")
    assert req.chat.messages[1].reasoning_content == "s" and req.chat.messages[1].tool_calls_json
    for bad in ([thought], [thought, {"role": "user", "content": "q"}],
                [{"type": "reasoning", "summary": []}, {"role": "assistant", "content": "a"}]):
        with pytest.raises(RouterError) as e:
            parse_responses({"input": bad}, "m")
        assert e.value.field == "input"


# -- the translation, without a cluster --------------------------------------------------------------

def test_input_items_become_chat_messages():
    body = {"instructions": "be brief", "max_output_tokens": 7, "input": [
        {"role": "developer", "content": "policy"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                        {"type": "input_text", "text": "b"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{\"x\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "done"}]}],
        "tools": [{"type": "function", "name": "f"}], "tool_choice": "auto"}
    req, opts, info = parse_responses(body, "m")
    msgs = req.chat.messages
    assert [(m.role, m.content) for m in msgs] == [("system", "be brief"), ("system", "policy"), ("user", "ab"),
                                                   ("assistant", ""), ("tool", "one"), ("assistant", "done")]
    assert [c["id"] for c in json.loads(msgs[3].tool_calls_json)] == ["c1", "c2"]  # consecutive calls: one turn
    assert msgs[4].tool_call_id == "c1"
    assert req.sampling_params.max_tokens == 7 and opts.chat and opts.tools is not None
    assert info.message_of_item == [-1, 0, 1, 2, 4, 5] and info.tool_choice == "auto"


def test_refusals_are_renamed_into_the_clients_terms():
    err = rename_error(invalid("max_tokens", "max_tokens=9000 + 5 prompt tokens exceeds 2048"))
    assert err.field == "max_output_tokens" and err.message.startswith("max_output_tokens=9000")
    err = rename_error(invalid("messages", "messages[1].content: only text parts are supported"), [-1, 0])
    assert err.field == "input" and err.message.startswith("input[0].content")
    err = rename_error(invalid("response_format", "response_format: bad"))
    assert err.field == "text.format"
    other = invalid("temperature", "must be a number")
    assert rename_error(other) is other
    with pytest.raises(RouterError) as e:  # a bad image part deep in the chat path names the input item
        parse_responses({"instructions": "x", "input": [
            {"role": "user", "content": [{"type": "input_image", "image_url": "not a url"}]}]}, "m")
    assert e.value.field == "input" and "input[0]" in e.value.message, e.value.message
