"""--reasoning-parser: the thought split from the answer, whole and streamed alike (pure policy)."""

from __future__ import annotations

import random

import pytest

from pdcluster.router.reasoning import REASONING_PARSERS, ReasoningSplitter, get_parser, split

R1, QWEN3 = REASONING_PARSERS["deepseek_r1"], REASONING_PARSERS["qwen3"]

CASES = [
    # parser, output, reasoning, content
    (R1, "I should add.</think>\n\n4", "I should add.", "\n\n4"),
    (R1, "<think>I should add.</think>4", "I should add.", "4"),
    (R1, "still thinking when cut off", "still thinking when cut off", ""),
    (R1, "", None, ""),
    (R1, "</think>just the answer", "", "just the answer"),
    (QWEN3, "<think>\nHmm.\n</think>\n\nParis.", "\nHmm.\n", "\n\nParis."),
    (QWEN3, "\n<think>x</think>y", "x", "y"),
    (QWEN3, "Paris.", None, "Paris."),
    (QWEN3, "<b>bold</b> and </think> stays", None, "<b>bold</b> and </think> stays"),
    (QWEN3, "<think>cut off", "cut off", ""),
    (QWEN3, "<thi", None, "<thi"),
    (QWEN3, "", None, ""),
    (R1, "a</thi", "a</thi", ""),
    (R1, "a</think", "a</think", ""),
]


@pytest.mark.parametrize("parser,text,reasoning,content", CASES)
def test_whole_answers(parser, text, reasoning, content) -> None:
    assert split(parser, text) == (reasoning, content)


@pytest.mark.parametrize("parser,text,reasoning,content", CASES)
def test_any_chunking_streams_the_same_fields(parser, text, reasoning, content) -> None:
    rng = random.Random(text)
    for _ in range(30):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        s = ReasoningSplitter(parser)
        got_r, got_c = "", ""
        for piece in pieces:
            r, c = s.feed(piece)
            got_r, got_c = got_r + r, got_c + c
        r, c = s.finish()
        assert (got_r + r if s.thought else None, got_c + c) == (reasoning, content), pieces


def test_unknown_parser_is_named() -> None:
    with pytest.raises(ValueError, match="--reasoning-parser 'o1'.*deepseek_r1"):
        get_parser("o1")


# -- the answer's shapes, from real worker response messages ------------------------------------------
from pdcluster._proto import common_pb2, worker_pb2  # noqa: E402
from pdcluster.router.openai_protocol import OpenAIOptions  # noqa: E402
from pdcluster.router.openai_responses import ResponseBuilder  # noqa: E402

STOP = common_pb2.FINISH_REASON_STOP


def _deltas(pieces: list[str]) -> list[worker_pb2.WorkerGenerateResponse]:
    out = [worker_pb2.WorkerGenerateResponse(request_id="r", text=p, token_ids=[7]) for p in pieces]
    out[-1].finished, out[-1].finish_reason = True, STOP
    return out


def _opts(parser=QWEN3, include=True) -> OpenAIOptions:
    return OpenAIOptions(model="m", stream=True, include_usage=False, logprobs=None, chat=True, reasoning=parser,
                         include_reasoning=include)


def test_chat_chunks_and_whole_answers_agree() -> None:
    pieces = ["<th", "ink>Two", " and two.</t", "hink>", "\n\n4", "."]
    b = ResponseBuilder("r", _opts(), 3, str)
    chunks = [c for d in _deltas(pieces) if (c := b.delta_chunk(d)) is not None]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning", "") for d in deltas) == "Two and two."
    assert "".join(d.get("content", "") for d in deltas) == "\n\n4."
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    whole = ResponseBuilder("r", _opts(), 3, str).choice("".join(pieces), STOP, [], None)["message"]
    assert whole == {"role": "assistant", "content": "\n\n4.", "reasoning": "Two and two."}
    hidden = ResponseBuilder("r", _opts(include=False), 3, str)
    assert hidden.choice("".join(pieces), STOP, [], None)["message"]["reasoning"] is None
    streamed = [hidden.delta_chunk(d) for d in _deltas(pieces)]
    assert not any("reasoning" in c["choices"][0]["delta"] for c in streamed if c)
    plain = ResponseBuilder("r", OpenAIOptions(model="m", stream=False, include_usage=False, logprobs=None, chat=True),
                            3, str).choice("".join(pieces), STOP, [], None)["message"]
    assert plain == {"role": "assistant", "content": "".join(pieces)}  # no parser: no field, the text as is
