from __future__ import annotations

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from pdcluster.engine.output_processor import OutputProcessor
from pdcluster.engine.outputs import EngineCoreOutput, Logprob, RequestOutput, SampleLogprobs
from pdcluster.engine.tokenizer import Tokenizer
from pdcluster.sampling_params import SamplingParams

PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    """Byte-level BPE trained on lowercase text only, so upper-case letters stay one token each."""
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|eos|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(["hello world, this is some text. 你好世界 😀"] * 20, trainer)
    return Tokenizer(backend, {"eos_token": "<|eos|>"})


def char_ids(tok: Tokenizer, text: str) -> list[int]:
    ids = tok.encode(text)
    assert len(ids) == len(text), "test text must be one token per character"
    return ids


def run(op: OutputProcessor, ids: list[int], rid: str = "r", per_step: int = 1, finish: str | None = "length",
        stop_reason: int | str | None = None) -> tuple[list[RequestOutput], list[list[str]]]:
    """Feed ids as engine steps; the last step carries `finish`. Returns outputs and stopped ids."""
    outs, stopped = [], []
    steps = [ids[i:i + per_step] for i in range(0, len(ids), per_step)]
    for n, step in enumerate(steps):
        last = n == len(steps) - 1
        eco = EngineCoreOutput(rid, step, finish_reason=finish if last else None,
                               stop_reason=stop_reason if last else None)
        got, stop = op.process_outputs([eco])
        outs.extend(got)
        stopped.append(stop)
    return outs, stopped


def add(op: OutputProcessor, rid: str = "r", **params: object) -> None:
    op.add_request(rid, "prompt", PROMPT, SamplingParams(max_tokens=100, **params))


def text_of(outs: list[RequestOutput]) -> str:
    return "".join(o.outputs[0].text for o in outs)


def test_streams_deltas_and_keeps_the_final_result(tok: Tokenizer) -> None:
    op = OutputProcessor(tok)
    add(op)
    ids = tok.encode("hello world, 你好 😀! ok")
    outs, stopped = run(op, ids)
    assert text_of(outs) == tok.decode(ids)
    assert [o.outputs[0].token_ids for o in outs] == [[i] for i in ids]
    assert all("\ufffd" not in o.outputs[0].text for o in outs)
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
    assert not any(stopped) and not op.has_unfinished_requests()
    final = op.get_final("r")
    assert final.outputs[0].text == tok.decode(ids) and final.outputs[0].token_ids == ids
    assert final.prompt == "prompt" and final.prompt_token_ids == PROMPT and final.finished
    with pytest.raises(KeyError):
        op.get_final("r")  # popped


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_deltas_is_never_streamed(tok: Tokenizer, include: bool) -> None:
    op = OutputProcessor(tok)
    add(op, stop=["STOP"], include_stop_str_in_output=include)
    ids = char_ids(tok, "AB SXSTOP CD")
    outs, stopped = run(op, ids)
    expected = "AB SXSTOP" if include else "AB SX"
    assert text_of(outs) == expected
    deltas = [o.outputs[0].text for o in outs]
    assert deltas[:4] == ["A", "B", " ", ""]  # "S" held back: it may start "STOP"
    assert deltas[4] == "SX"  # released as soon as "SX" cannot start it
    assert stopped[8] == ["r"] and sum(map(len, stopped)) == 1  # stopped when "P" arrived
    last = outs[-1]
    assert last.finished and last.outputs[0].finish_reason == "stop" and last.outputs[0].stop_reason == "STOP"
    assert len(outs) == 9  # later engine outputs for a stopped request are ignored
    final = op.get_final("r").outputs[0]
    assert final.text == expected and final.token_ids == ids[:9]


def test_stop_in_a_multi_token_step_ends_where_one_token_steps_end(tok: Tokenizer) -> None:
    """Several tokens in one step (accepted speculative drafts): the output ends at the token that
    completed the stop string, tokens included, as when they come one step at a time."""
    op = OutputProcessor(tok)
    add(op, stop=["QR"])
    ids = char_ids(tok, "ABQRCD")
    outs, stopped = run(op, ids, per_step=6, finish=None)
    assert text_of(outs) == "AB" and stopped == [["r"]]
    assert outs[0].outputs[0].token_ids == ids[:4]
    assert op.get_final("r").outputs[0].token_ids == ids[:4]


@pytest.mark.parametrize(
    "stops, include, text, reason",
    [
        (["D", "B C"], False, "A ", "B C"),  # earliest start wins, not list order
        (["STOP", "ST"], True, "A B CST", "ST"),  # same start: the shorter (completes first) wins
    ],
)
def test_earliest_stop_wins(tok: Tokenizer, stops: list[str], include: bool, text: str, reason: str) -> None:
    op = OutputProcessor(tok)
    add(op, stop=stops, include_stop_str_in_output=include)
    outs, _ = run(op, char_ids(tok, "A B CSTOP D"), per_step=20)
    assert text_of(outs) == text and outs[-1].outputs[0].stop_reason == reason


def test_stop_strings_ignore_text_of_the_first_min_tokens(tok: Tokenizer) -> None:
    op = OutputProcessor(tok)
    add(op, stop=["XY"], min_tokens=3)
    outs, _ = run(op, char_ids(tok, "XYAXYB"), per_step=2)
    # The first "XY" ends within the first 3 tokens; the second counts.
    assert text_of(outs) == "XYA" and outs[-1].outputs[0].stop_reason == "XY"


def test_held_back_text_is_flushed_when_the_engine_finishes(tok: Tokenizer) -> None:
    op = OutputProcessor(tok)
    add(op, stop=["QRS"])
    outs, stopped = run(op, char_ids(tok, "AQR"), finish="length")
    assert [o.outputs[0].text for o in outs] == ["A", "", "QR"]
    assert outs[-1].outputs[0].finish_reason == "length" and stopped[-1] == []


def test_stop_string_overrides_engine_finish_in_the_same_step(tok: Tokenizer) -> None:
    op = OutputProcessor(tok)
    add(op, stop=["QR"])
    outs, stopped = run(op, char_ids(tok, "AQRB"), per_step=4, finish="length")
    assert text_of(outs) == "A" and outs[-1].outputs[0].finish_reason == "stop"
    assert stopped == [[]]  # the engine already finished it: nothing to abort


@pytest.mark.parametrize("include", [False, True])
def test_eos_stop_token_is_not_text(tok: Tokenizer, include: bool) -> None:
    op = OutputProcessor(tok)
    add(op, skip_special_tokens=False, include_stop_str_in_output=include)
    ids = [*char_ids(tok, "AB"), tok.eos_token_id]
    outs, _ = run(op, ids, finish="stop", stop_reason=None)
    assert text_of(outs) == ("AB<|eos|>" if include else "AB")
    assert op.get_final("r").outputs[0].token_ids == ids


def test_detokenize_false_and_no_tokenizer(tok: Tokenizer) -> None:
    op = OutputProcessor(tok)
    add(op, detokenize=False)
    outs, _ = run(op, char_ids(tok, "AB"))
    assert text_of(outs) == "" and op.get_final("r").outputs[0].token_ids == char_ids(tok, "AB")
    with pytest.raises(ValueError, match="detokenize"):
        add(op, "s", detokenize=False, stop=["x"])
    bare = OutputProcessor(None)
    with pytest.raises(ValueError):
        add(bare, stop=["x"])
    add(bare)
    outs, _ = run(bare, [5, 6])
    assert text_of(outs) == "" and outs[-1].finished


def test_logprobs_pass_through_and_accumulate(tok: Tokenizer) -> None:
    op = OutputProcessor(tok)
    add(op, logprobs=1)
    add(op, "plain")
    lp = [SampleLogprobs(Logprob(7, -0.5, 1), [Logprob(7, -0.5, 1)]),
          SampleLogprobs(Logprob(8, -1.0, 2), [Logprob(9, -0.7, 1)])]
    out, _ = op.process_outputs([EngineCoreOutput("r", [7], [lp[0]]), EngineCoreOutput("plain", [7])])
    assert out[0].outputs[0].logprobs == [lp[0]] and out[0].outputs[0].cumulative_logprob == -0.5
    assert out[1].outputs[0].logprobs is None and out[1].outputs[0].cumulative_logprob is None
    op.process_outputs([EngineCoreOutput("r", [8], [lp[1]], finish_reason="length")])
    final = op.get_final("r").outputs[0]
    assert final.logprobs == lp and final.cumulative_logprob == -1.5


def test_request_bookkeeping(tok: Tokenizer) -> None:
    op = OutputProcessor(tok, keep_finished=False)
    add(op)
    with pytest.raises(ValueError, match="already exists"):
        add(op)
    assert op.process_outputs([EngineCoreOutput("unknown", [1])]) == ([], [])
    assert op.get_final("r").finished is False  # snapshot of a running request
    out, _ = op.process_outputs([EngineCoreOutput("r", [5], finish_reason="abort", num_cached_tokens=2,
                                                  kv_transfer_params={"k": 1})])
    assert out[0].finished and out[0].num_cached_tokens == 2 and out[0].kv_transfer_params == {"k": 1}
    with pytest.raises(KeyError):
        op.get_final("r")  # keep_finished=False: no state left
    add(op, "gone")
    op.abort_request("gone")
    assert not op.has_unfinished_requests()


def _disaggregated(tok: Tokenizer, ids: list[int], **params: object) -> tuple[str, str | None, int | str | None]:
    """A prefill leg that samples ids[0] and hands off, then a decode leg that continues after it
    (as the router drives them): the client sees the prefill leg's text, then the decode leg's."""
    pre = OutputProcessor(tok)
    pre.add_request("r", "prompt", PROMPT, SamplingParams(max_tokens=1, **params), continues_elsewhere=True)
    first, _ = pre.process_outputs([EngineCoreOutput("r", ids[:1], finish_reason="length")])
    out = first[0].outputs[0]
    if out.finish_reason != "length":  # the first token already ended the request
        return out.text, out.finish_reason, out.stop_reason
    dec = OutputProcessor(tok)
    dec.add_request("r", "prompt", PROMPT, SamplingParams(max_tokens=100, **params), prior_output_token_ids=ids[:1])
    outs, _ = run(dec, ids[1:])
    last = outs[-1].outputs[0]
    return out.text + text_of(outs), last.finish_reason, last.stop_reason


@pytest.mark.parametrize("params", [
    {},
    {"stop": ["lo w"]},  # spans the first token's text and the next ones
    {"stop": ["he"]},
    {"stop": ["he"], "min_tokens": 1},  # the floor sits inside the first token's text
    {"stop": ["o wor", "好世"], "include_stop_str_in_output": True},
    {"stop": ["世"]},  # multi-byte: the first tokens may be bytes of one character
])
@pytest.mark.parametrize("text", ["hello world", "你好世界 😀 hello", "😀 hello"])
def test_disaggregated_legs_stream_the_same_text_as_one_request(tok: Tokenizer, params: dict, text: str) -> None:
    ids = tok.encode(text)
    op = OutputProcessor(tok)
    add(op, **params)
    outs, _ = run(op, ids)
    last = outs[-1].outputs[0]
    want = (text_of(outs), last.finish_reason, last.stop_reason)
    assert _disaggregated(tok, ids, **params) == want
