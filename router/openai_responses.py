"""Worker deltas -> OpenAI response objects (whole responses and SSE stream chunks)."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any

from pdcluster._proto import common_pb2, worker_pb2

from .openai_protocol import OpenAIOptions
from .openai_tools import extract_tool_calls
from .reasoning import ReasoningSplitter, split
from .tool_stream import ToolCallStream, streams

FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",  # vLLM's name for a request ended by cancellation
    common_pb2.FINISH_REASON_ERROR: "error",
}

TokenDecoder = Callable[[int], str]


class ResponseBuilder:
    """Shapes one request's answer; holds the id, creation time and running usage counts."""

    def __init__(self, request_id: str, opts: OpenAIOptions, num_prompt_tokens: int, decode_token: TokenDecoder,
                 *, index: int = 0, echo: str = "", first_prompt_token: int | None = None,
                 prompt_token_ids: Sequence[int] = ()) -> None:
        """index: the choice's index (n > 1, batched prompts); echo: text put before the choice's
        own (completions' echo: the prompt), in the whole answer or the stream's first chunk;
        first_prompt_token: the prompt's first token id (echo with logprobs lists it, without one);
        prompt_token_ids: what return_token_ids reports for the prompt."""
        self.id = ("chatcmpl-" if opts.chat else "cmpl-") + request_id
        self.index = index
        self._echo = echo
        self._held: list[str] = []  # chat with tools: the text until the answer is complete
        self.opts = opts
        self.created = int(time.time())
        self.num_prompt_tokens = num_prompt_tokens
        self.num_completion_tokens = 0
        self.num_cached_tokens = 0
        self._decode_token = decode_token
        self._text_offset = 0
        self._first_prompt_token = first_prompt_token
        self.prompt_logprobs: list[common_pb2.SampleLogprobs] = []  # from the first delta, when asked
        # --reasoning-parser: the streamed text's split (whole answers use reasoning.split)
        self._splitter = ReasoningSplitter(opts.reasoning) if opts.reasoning is not None else None
        # tool_choice auto with a built-in parser: content streams up to where a call may start
        self._tool_stream = (ToolCallStream(opts.tools) if opts.chat and streams(opts.tools)
                             and opts.reasoning is None else None)
        # return_token_ids: the prompt's ids, every output id so far, and those no chunk carried yet
        self._prompt_ids = list(prompt_token_ids) if opts.return_token_ids else None
        self._ids: list[int] = []
        self._unsent_ids: list[int] = []
        self._ids_started = False

    # -- pieces ---------------------------------------------------------------------------------
    def account(self, delta: worker_pb2.WorkerGenerateResponse) -> None:
        if delta.prompt_logprobs:
            self.prompt_logprobs = list(delta.prompt_logprobs)
        self.num_completion_tokens += len(delta.token_ids)
        if self._prompt_ids is not None:
            self._ids.extend(delta.token_ids)
            self._unsent_ids.extend(delta.token_ids)
        if delta.HasField("usage"):
            u = delta.usage
            self.num_prompt_tokens = u.prompt_tokens or self.num_prompt_tokens
            self.num_completion_tokens = u.completion_tokens or self.num_completion_tokens
            self.num_cached_tokens = u.cached_tokens

    def usage(self) -> dict[str, Any]:
        usage: dict[str, Any] = {"prompt_tokens": self.num_prompt_tokens,
                                 "completion_tokens": self.num_completion_tokens,
                                 "total_tokens": self.num_prompt_tokens + self.num_completion_tokens}
        if self.num_cached_tokens:
            usage["prompt_tokens_details"] = {"cached_tokens": self.num_cached_tokens}
        return usage

    def _token_text(self, lp: common_pb2.TokenLogprob) -> str:
        return lp.decoded or self._decode_token(lp.token_id)

    def logprobs(self, entries: Sequence[common_pb2.SampleLogprobs]) -> dict[str, Any] | None:
        if self.opts.logprobs is None or not entries:
            return None
        if self.opts.chat:
            return {"content": [self._chat_logprob(e) for e in entries]}
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top: list[dict[str, float] | None] = []
        offsets: list[int] = []
        if self.opts.echo and self._first_prompt_token is not None:
            # The echoed prompt's tokens first: the first has no logprob (nothing predicts it).
            first = self._decode_token(self._first_prompt_token)
            tokens.append(first)
            token_logprobs.append(None)
            top.append(None)
            offsets.append(self._text_offset)
            self._text_offset += len(first)
            entries = [*self.prompt_logprobs, *entries]
            self._first_prompt_token = None  # once: the whole answer is built once
        for e in entries:
            text = self._token_text(e.sampled)
            tokens.append(text)
            token_logprobs.append(e.sampled.logprob)
            top.append({self._token_text(t): t.logprob for t in e.top})
            offsets.append(self._text_offset)
            self._text_offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def vllm_prompt_logprobs(self) -> list[dict[str, Any] | None]:
        """vLLM's prompt_logprobs: None for the first prompt token, then per token a map of token id
        -> logprob, rank and text, holding the prompt token itself and the top-n alternatives."""
        def one(t: common_pb2.TokenLogprob) -> dict[str, Any]:
            return {"logprob": max(t.logprob, -9999.0), "rank": t.rank, "decoded_token": self._token_text(t)}

        out: list[dict[str, Any] | None] = [None]
        for e in self.prompt_logprobs:
            entry = {str(e.sampled.token_id): one(e.sampled)}
            entry.update((str(t.token_id), one(t)) for t in e.top if str(t.token_id) not in entry)
            out.append(entry)
        return out

    def _chat_logprob(self, e: common_pb2.SampleLogprobs) -> dict[str, Any]:
        def one(t: common_pb2.TokenLogprob) -> dict[str, Any]:
            text = self._token_text(t)
            return {"token": text, "logprob": t.logprob, "bytes": list(text.encode())}

        return {**one(e.sampled), "top_logprobs": [one(t) for t in e.top]}

    # -- whole responses ------------------------------------------------------------------------
    def choice(self, text: str, finish: int, logprobs: list[common_pb2.SampleLogprobs],
               stop_reason: int | str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": self.index, "logprobs": self.logprobs(logprobs),
                                  "finish_reason": FINISH_REASONS.get(finish), "stop_reason": stop_reason}
        if self.opts.chat:
            reasoning, text = self.split_reasoning(text)
            if self.opts.tools is not None:
                content, calls = extract_tool_calls(text, self.opts.tools)
                choice["message"] = {"role": "assistant", "content": content}
                if calls:
                    choice["message"]["tool_calls"] = calls
                    if choice["finish_reason"] == "stop":
                        choice["finish_reason"] = "tool_calls"
            else:
                choice["message"] = {"role": "assistant", "content": self._echo + text}
            if self.opts.reasoning is not None:
                choice["message"]["reasoning"] = reasoning
        else:
            choice["text"] = self._echo + text
            if self.opts.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self.vllm_prompt_logprobs()
            if self._prompt_ids is not None:
                choice["prompt_token_ids"] = self._prompt_ids
        if self._prompt_ids is not None:
            choice["token_ids"] = list(self._ids)
        return choice

    def split_reasoning(self, text: str) -> tuple[str | None, str]:
        """(thought or None, answer) of a whole chat answer; the thought is None when the request
        has no parser or asked include_reasoning=false."""
        if self.opts.reasoning is None:
            return None, text
        reasoning, content = split(self.opts.reasoning, text)
        return (reasoning if self.opts.include_reasoning else None), content

    def full(self, text: str, finish: int, logprobs: list[common_pb2.SampleLogprobs],
             stop_reason: int | str | None) -> dict[str, Any]:
        return self.response([self.choice(text, finish, logprobs, stop_reason)], self.usage())

    def response(self, choices: list[dict[str, Any]], usage: dict[str, Any]) -> dict[str, Any]:
        obj = "chat.completion" if self.opts.chat else "text_completion"
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.opts.model,
                "choices": choices, "usage": usage}
        if self.opts.chat and self.opts.prompt_logprobs is not None:
            body["prompt_logprobs"] = self.vllm_prompt_logprobs()  # vLLM's place for chat: the response
        if self.opts.chat and self._prompt_ids is not None:
            body["prompt_token_ids"] = self._prompt_ids  # likewise
        return body

    # -- stream chunks --------------------------------------------------------------------------
    def role_chunk(self) -> dict[str, Any]:
        """Chat streams open with the assistant role, as OpenAI's do."""
        echo, self._echo = self._echo, ""  # chat's echo: the continued message, before any new text
        chunk = self._chunk({"index": self.index, "delta": {"role": "assistant", "content": echo}, "logprobs": None,
                             "finish_reason": None}, ids=False)
        if self._prompt_ids is not None:
            chunk["prompt_token_ids"] = self._prompt_ids  # vLLM's: on the first chunk
        return chunk

    def delta_chunk(self, delta: worker_pb2.WorkerGenerateResponse) -> dict[str, Any] | None:
        """The chunk for one delta; None while a chat with tools holds its text back."""
        if self.opts.chat and self.opts.tools is not None:
            return self._tool_chunk(delta)
        finish = FINISH_REASONS.get(delta.finish_reason) if delta.finished else None
        choice: dict[str, Any] = {"index": self.index, "logprobs": self.logprobs(delta.logprobs),
                                  "finish_reason": finish}
        if self.opts.chat and self._splitter is not None:
            choice["delta"] = self._reasoning_delta(delta)
            if not choice["delta"] and not delta.finished and not delta.logprobs:
                return None  # all of it held back (a tag may be starting)
        elif self.opts.chat:
            choice["delta"] = {"content": delta.text} if delta.text or not delta.finished else {}
        else:
            choice["text"] = self._echo + delta.text
            self._echo = ""
        if delta.finished:
            choice["stop_reason"] = stop_reason(delta)
        return self._chunk(choice)

    def _reasoning_delta(self, delta: worker_pb2.WorkerGenerateResponse) -> dict[str, Any]:
        assert self._splitter is not None
        reasoning, content = self._splitter.feed(delta.text)
        if delta.finished:
            more_reasoning, more_content = self._splitter.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        out: dict[str, Any] = {}
        if reasoning and self.opts.include_reasoning:
            out["reasoning"] = reasoning
        if content:
            out["content"] = content
        return out

    def _tool_chunk(self, delta: worker_pb2.WorkerGenerateResponse) -> dict[str, Any] | None:
        mode = self.opts.tools
        assert mode is not None
        if mode.choice == "named":
            return self._named_tool_chunk(delta, mode.name or "")
        if self._tool_stream is not None:
            return self._streamed_tool_chunk(delta, self._tool_stream)
        self._held.append(delta.text)
        if not delta.finished:
            return None
        choice = self.choice("".join(self._held), delta.finish_reason, [], stop_reason(delta))
        message = choice.pop("message")
        out: dict[str, Any] = {}
        if message.get("reasoning"):
            out["reasoning"] = message["reasoning"]
        if message.get("content"):
            out["content"] = message["content"]
        if message.get("tool_calls"):
            out["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
        choice["delta"] = out
        choice["logprobs"] = None
        return self._chunk(choice)

    def _streamed_tool_chunk(self, delta: worker_pb2.WorkerGenerateResponse, ts: ToolCallStream
                             ) -> dict[str, Any] | None:
        """tool_choice auto: the text no parse can take back as content now; at the end the rest
        of the content and the calls, as the whole answer's parse gives them (tool_stream.py)."""
        content = ts.feed(delta.text)
        if not delta.finished:
            if not content:
                return None
            return self._chunk({"index": self.index, "delta": {"content": content}, "logprobs": None,
                                "finish_reason": None})
        tail, calls = ts.finish()
        content += tail or ""
        finish = FINISH_REASONS.get(delta.finish_reason)
        out: dict[str, Any] = {"content": content} if content else {}
        if calls:
            out["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls)]
            finish = "tool_calls" if finish == "stop" else finish
        return self._chunk({"index": self.index, "delta": out, "logprobs": None, "finish_reason": finish,
                            "stop_reason": stop_reason(delta)})

    def _named_tool_chunk(self, delta: worker_pb2.WorkerGenerateResponse, name: str) -> dict[str, Any] | None:
        """A forced function's arguments are the output itself: streamed as argument fragments,
        the first chunk carrying the call's id and name (what the openai client assembles)."""
        call: dict[str, Any] = {"index": 0, "function": {"arguments": delta.text}}
        if not self._held:
            self._held.append("started")
            call.update(id=f"call_{secrets.token_hex(12)}", type="function")
            call["function"]["name"] = name
        finish = None
        if delta.finished:
            finish = FINISH_REASONS.get(delta.finish_reason)
            finish = "tool_calls" if finish == "stop" else finish
        if not delta.text and not delta.finished and "id" not in call:
            return None
        choice: dict[str, Any] = {"index": self.index, "logprobs": None, "finish_reason": finish,
                                  "delta": {"tool_calls": [call]} if delta.text or "id" in call else {}}
        if delta.finished:
            choice["stop_reason"] = stop_reason(delta)
        return self._chunk(choice)

    def usage_chunk(self, usage: dict[str, Any] | None = None) -> dict[str, Any]:
        chunk = self._chunk(None)
        chunk["usage"] = usage or self.usage()
        return chunk

    def _chunk(self, choice: dict[str, Any] | None, ids: bool = True) -> dict[str, Any]:
        if choice is not None and ids and self._prompt_ids is not None:
            # The ids of the text this chunk carries: all taken since the last chunk (a chat with
            # tools holds text back, and its ids with it).
            choice["token_ids"], self._unsent_ids = self._unsent_ids, []
            if not self.opts.chat and not self._ids_started:
                choice["prompt_token_ids"] = self._prompt_ids  # completions: on the first chunk's choice
            self._ids_started = True
        chunk = {"id": self.id, "object": "chat.completion.chunk" if self.opts.chat else "text_completion",
                 "created": self.created, "model": self.opts.model, "choices": [choice] if choice else []}
        if self.opts.continuous_usage and choice is not None:
            chunk["usage"] = self.usage()  # vLLM's continuous_usage_stats: the counts so far
        elif self.opts.include_usage:
            chunk["usage"] = None  # OpenAI: null on every chunk but the last
        return chunk


def merged_usage(builders: Sequence[ResponseBuilder], prompt_builders: Sequence[ResponseBuilder]) -> dict[str, Any]:
    """Usage of a fanned-out request: every generation's completion tokens, each prompt once."""
    prompt = sum(b.num_prompt_tokens for b in prompt_builders)
    completion = sum(b.num_completion_tokens for b in builders)
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                             "total_tokens": prompt + completion}
    cached = sum(b.num_cached_tokens for b in builders)
    if cached:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def stop_reason(delta: worker_pb2.WorkerGenerateResponse) -> int | str | None:
    which = delta.WhichOneof("stop_reason")
    return getattr(delta, which) if which else None
