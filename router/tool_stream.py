"""Streaming a chat answer under tool_choice "auto": its text streams as content up to where a
tool call may begin, and the calls (with any content after them) come with the last chunk.

The answer is read at the end by the server's tool call parser (tool_parsers.py), exactly as a
non-streamed answer is, so the calls are the same. What streams before that is only text that no
outcome of the parse can take back: for each built-in format, the text before the first place a
call can start.

    hermes       before `<tool_call>` (a partial marker at the end is held)
    mistral      before `[TOOL_CALLS]`, unless the answer opens with `[` (a list without the marker)
    llama3_json  everything, unless the answer opens with `{` or `<|python_tag|>` (then all is held)
    pythonic     everything, unless the answer opens with `[` or `<|python_start|>`

Whitespace at the end of the streamed text is held back until more text follows (a parse with
calls strips the content before them). Leading whitespace streams with the first word: were a call
to follow that content, the parse would strip it, and the stream then carries that whitespace where
the whole answer has none (the one difference; models rarely start with whitespace). An operator's
own parser (a dotted path or an entry point) is unknown here: its answers are held to the end.
"""

from __future__ import annotations

import logging
from typing import Any

from .openai_tools import ToolMode, extract_tool_calls

log = logging.getLogger(__name__)

# Per built-in parser: (markers a call starts at anywhere, prefixes that make the whole answer a
# possible call when it opens with them).
_FORMATS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "hermes": (("<tool_call>",), ()),
    "mistral": (("[TOOL_CALLS]",), ("[",)),
    "llama3_json": ((), ("{", "<|python_tag|>")),
    "pythonic": ((), ("[", "<|python_start|>")),
}


def streams(mode: ToolMode | None) -> bool:
    """Whether an answer under `mode` streams its content (tool_choice auto, a built-in parser)."""
    return mode is not None and mode.choice == "auto" and mode.parser in _FORMATS


class ToolCallStream:
    """feed() each delta's text, then finish() once: what to send as content now, and at the end
    the rest of the content and the calls, as the whole answer's parse gives them."""

    def __init__(self, mode: ToolMode) -> None:
        if not streams(mode):
            raise ValueError(f"tool call parser {mode.parser!r} under tool_choice {mode.choice!r} does not stream")
        self.mode = mode
        self._markers, self._openers = _FORMATS[mode.parser]
        self._text = ""
        self._sent = 0  # characters of _text sent as content
        self._held = False  # a call may start at _sent: nothing more is sent before finish()
        self._opening_known = not self._openers  # whether the answer's opening was checked

    def feed(self, text: str) -> str:
        self._text += text
        if self._held:
            return ""
        safe = self._safe_end()
        if safe <= self._sent:
            return ""
        out = self._text[self._sent:safe]
        self._sent = safe
        return out

    def finish(self) -> tuple[str | None, list[dict[str, Any]]]:
        """(content not yet sent or None, the calls) from the parse of the whole answer."""
        content, calls = extract_tool_calls(self._text, self.mode)
        sent = self._text[:self._sent]
        if content is None:
            return None, calls
        for prefix in (sent, sent.lstrip()):
            if content.startswith(prefix):
                return content[len(prefix):] or None, calls
        log.warning("tool call stream: the parsed content does not continue the streamed text")  # by design never
        return None, calls

    def _safe_end(self) -> int:
        """How far the text can be sent: up to where a call may start, less trailing whitespace.
        Each feed looks only at the text after what was sent (a marker cannot start inside it)."""
        text = self._text
        if not self._opening_known:
            head = text.lstrip()
            if not head:
                return 0  # nothing but whitespace yet: its fate depends on what follows
            if any(head.startswith(p) for p in self._openers):
                self._held = True  # the answer may be a call from its first character
                return 0
            if any(p.startswith(head) for p in self._openers):
                return 0  # too short to tell yet
            self._opening_known = True
        end = len(text)
        for marker in self._markers:
            found = text.find(marker, self._sent)
            if found >= 0:
                end = min(end, found)
                self._held = True
            else:  # a marker may be starting at the end: hold its longest partial match
                for n in range(min(len(marker) - 1, len(text)), 0, -1):
                    if text.endswith(marker[:n]):
                        end = min(end, len(text) - n)
                        break
        return len(text[:end].rstrip())
