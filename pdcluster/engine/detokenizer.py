"""IncrementalDetokenizer: the text of each new token, without re-decoding the whole output.

Prefix/read-offset method over a short sliding window of ids:

    window = [ ...prefix ids... | ...pending ids... ]
              ^0                ^read
    delta  = decode(window)[len(decode(window[:read])):]

The prefix gives the decoder its context (a SentencePiece "▁word" token decodes to " word" only
after another token; a leading one is stripped), and is dropped once a delta is emitted, so each
step decodes a handful of ids: O(1) amortised per token.

A byte-level BPE token can end inside a multi-byte UTF-8 character; the decoder then yields
U+FFFD at the end. Such text is held back (pending ids stay in the window) until a later token
completes the character, so no delta ever carries a broken character. `finish()` flushes what is
still held back.

Invariant: "".join(deltas) + finish() == decoder(context + output)[len(decoder(context)):] where
context is the last few prompt ids; for byte-level BPE (GPT-2, Llama-3, Qwen) this equals
tokenizer.decode(output_ids). For decoders that strip a leading space (SentencePiece "Strip"),
the text keeps the space the first output token carries after the prompt, as vLLM does.
"""

from __future__ import annotations

from pdcluster.engine.tokenizer import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"
# Prompt ids used as decoding context for the first output token (vLLM uses the same number).
_NUM_CONTEXT_IDS = 5


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self._backend = tokenizer.backend
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-_NUM_CONTEXT_IDS:])
        context_text = self._decode(context)
        if context_text.endswith(_REPLACEMENT_CHAR):
            # The prompt ends inside a character (raw ids from a client): its text is not a clean
            # prefix of what follows, so decode the output without context.
            context, context_text = [], ""
        self._window: list[int] = context
        self._read_offset = len(context)  # window[:read_offset] is context already turned into text
        self._prefix_text = context_text
        self._chunks: list[str] = []
        self._text_cache: str | None = ""
        self.output_token_ids: list[int] = []

    @property
    def output_text(self) -> str:
        """All text emitted so far (excludes what is held back)."""
        if self._text_cache is None:
            self._text_cache = "".join(self._chunks)
            self._chunks = [self._text_cache]
        return self._text_cache

    @property
    def num_held_back_ids(self) -> int:
        return len(self._window) - self._read_offset

    def add(self, new_token_ids: list[int]) -> str:
        """Append ids; return the text they complete ("" while a character is unfinished)."""
        self.output_token_ids.extend(new_token_ids)
        pieces = [self._step(token_id) for token_id in new_token_ids]
        return self._emit("".join(pieces))

    def finish(self) -> str:
        """Flush held-back ids (an incomplete character at the very end decodes to U+FFFD, as in
        tokenizer.decode)."""
        if self.num_held_back_ids == 0:
            return ""
        text = self._decode(self._window)
        delta = text[len(self._prefix_text):] if text.startswith(self._prefix_text) else text
        self._advance()
        return self._emit(delta)

    # -- internals ----------------------------------------------------------------------------
    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip_special_tokens) if ids else ""

    def _step(self, token_id: int) -> str:
        self._window.append(token_id)
        text = self._decode(self._window)
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT_CHAR):
            # Nothing new yet (special token skipped) or a character is still incomplete.
            return ""
        delta = text[len(self._prefix_text):]
        self._advance()
        return delta

    def _advance(self) -> None:
        # The ids just turned into text become the next prefix; older ids are no longer needed.
        self._window = self._window[self._read_offset:]
        self._read_offset = len(self._window)
        self._prefix_text = self._decode(self._window)

    def _emit(self, delta: str) -> str:
        if delta:
            self._chunks.append(delta)
            self._text_cache = None
        return delta
