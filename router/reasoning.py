"""Reasoning text split from the answer (vLLM's `--reasoning-parser`): models that think between
`<think>` and `</think>` before answering get the thought in `message.reasoning` (vLLM's field)
and only the answer in `message.content`.

    deepseek_r1   the output starts thinking (the template opened `<think>` in the prompt); a
                  leading `<think>` is dropped; `</think>` ends the thought. No `</think>` at all:
                  everything was thought.
    qwen3         thinking only when the output opens with `<think>` (leading whitespace allowed);
                  otherwise (e.g. Qwen3's enable_thinking=false) everything is the answer.

One state machine serves whole answers and streams alike, so a streamed answer's pieces add up to
the whole answer's fields. While the text might still be a tag (a chunk ending in "</thi"), that
tail is held back until the next chunk or the end says what it was.

Structured output and forced tool calls constrain the output from its first token, so there is no
room for a thought there: those requests are not split (see `for_request`).
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    starts_thinking: bool  # deepseek_r1: in the thought from the first token


REASONING_PARSERS = {p.name: p for p in (ReasoningParser("deepseek_r1", True), ReasoningParser("qwen3", False))}


def for_request(name: str | None, structured: bool, forced_tool: bool) -> ReasoningParser | None:
    """The parser a chat request's answer goes through: none without --reasoning-parser, and none
    when a grammar shapes the output from its first token (structured output, forced tools)."""
    if name is None or structured or forced_tool:
        return None
    return get_parser(name)


def get_parser(name: str) -> ReasoningParser:
    parser = REASONING_PARSERS.get(name)
    if parser is None:
        raise ValueError(f"--reasoning-parser {name!r} is not one of {sorted(REASONING_PARSERS)}")
    return parser


class ReasoningSplitter:
    """feed(text) -> (reasoning, content) of that piece; finish() -> what was held back."""

    def __init__(self, parser: ReasoningParser) -> None:
        # "open": before any output (qwen3: is it `<think>`?); "think": in the thought; "answer".
        self._state = "think_start" if parser.starts_thinking else "open"
        self._held = ""
        self.thought = False  # whether the output had a thought at all (reasoning may be "")

    def feed(self, text: str) -> tuple[str, str]:
        text = self._held + text
        self._held = ""
        reasoning: list[str] = []
        content: list[str] = []
        while text:
            if self._state in ("open", "think_start"):
                stripped = text.lstrip()
                if stripped.startswith(START):
                    self._state, text, self.thought = "think", stripped[len(START):], True
                elif START.startswith(stripped):  # whitespace or a piece of `<think>`: wait
                    self._held = text
                    return "".join(reasoning), "".join(content)
                else:
                    self.thought = self._state == "think_start"
                    self._state = "think" if self.thought else "answer"
            elif self._state == "think":
                i = text.find(END)
                if i >= 0:
                    reasoning.append(text[:i])
                    self._state, text = "answer", text[i + len(END):]
                    continue
                keep = _partial_tag_tail(text, END)
                reasoning.append(text[:len(text) - keep])
                self._held = text[len(text) - keep:]
                return "".join(reasoning), "".join(content)
            else:
                content.append(text)
                text = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The end of the output: held text is what it looked like it might not be."""
        held, self._held = self._held, ""
        if self._state == "think_start" and held:
            self.thought = True
        return (held, "") if self._state in ("think", "think_start") else ("", held)


def split(parser: ReasoningParser, text: str) -> tuple[str | None, str]:
    """A whole answer -> (reasoning or None when there was no thought, content)."""
    s = ReasoningSplitter(parser)
    r1, c1 = s.feed(text)
    r2, c2 = s.finish()
    return (r1 + r2 if s.thought else None), c1 + c2


def _partial_tag_tail(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningSplitter", "for_request", "get_parser", "split"]
