"""OutputProcessor: token-level EngineCoreOutputs -> text-level RequestOutput deltas.

Per request it owns the text state the scheduler does not: the incremental detokenizer, stop
strings, and the accumulated result for offline use.

Stop strings. Text from the detokenizer first lands in a small `held` buffer:

    emitted (streamed, final)          | held (may still become a stop string) | new delta
                                       ^ every future match starts here or later

After each step the buffer is searched for complete stop strings (earliest start wins, then the
shortest); with none, everything before the earliest position whose suffix is a proper prefix of
some stop string is streamed and the rest stays held. So no client ever sees part of a stop
string, and a match can never start in text already streamed. Like vLLM, a stop string only counts
when it ends after the text of the first min_tokens tokens.

A stopped request is returned in `stopped_request_ids`: the engine aborts it in the scheduler.
Tokens stopped by eos / stop_token_ids (finish_reason "stop" from the engine) are kept in
token_ids but not in the text, unless include_stop_str_in_output.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pdcluster.engine.detokenizer import IncrementalDetokenizer
from pdcluster.engine.kv_transfer_params import KVTransferParams
from pdcluster.engine.outputs import CompletionOutput, EngineCoreOutput, RequestOutput, SampleLogprobs
from pdcluster.engine.tokenizer import Tokenizer
from pdcluster.sampling_params import SamplingParams


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[SampleLogprobs] | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list[SampleLogprobs] | None = None
    chunks: list[str] = field(default_factory=list)  # streamed text, in order
    num_emitted_chars: int = 0
    held: str = ""
    # Absolute char offset where the text of the first min_tokens tokens ends: stop strings must end
    # after it.
    stop_floor: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    error_field: str | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: KVTransferParams | None = None
    num_prior_tokens: int = 0  # output tokens generated before this request (not in token_ids)
    # A disaggregated prefill leg: the request goes on in a decode leg, so a finish by length is a
    # hand-off, not the end of the text (held text and undecoded bytes stay unemitted).
    continues_elsewhere: bool = False

    @property
    def handing_off(self) -> bool:
        return self.continues_elsewhere and self.finish_reason == "length"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, *, keep_finished: bool = True) -> None:
        """keep_finished: keep each finished request's whole result until `get_final` takes it
        (offline LLM). Streaming services pass False so finished requests leave no state."""
        self.tokenizer = tokenizer
        self.keep_finished = keep_finished
        self._active: dict[str, _RequestState] = {}
        self._finished: dict[str, _RequestState] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        prior_output_token_ids: list[int] | None = None,
        continues_elsewhere: bool = False,
    ) -> None:
        """prior_output_token_ids: output generated elsewhere (a decode leg starts with the prefill
        leg's token): counted for min_tokens, never emitted again, and replayed through the text
        state exactly as the prefill leg processed it, so a stop string that starts in the prefill
        leg's text and ends in ours is found, and text it held back is emitted here.
        continues_elsewhere: this is that prefill leg (see _RequestState.continues_elsewhere)."""
        prior = list(prior_output_token_ids or ())
        if request_id in self._active or request_id in self._finished:
            raise ValueError(f"request {request_id!r} already exists")
        detokenize = sampling_params.detokenize and self.tokenizer is not None
        if sampling_params.stop and not detokenize:
            raise ValueError("stop strings need detokenize=True and a tokenizer")
        detok = None
        if detokenize:
            assert self.tokenizer is not None
            skip = sampling_params.skip_special_tokens
            detok = IncrementalDetokenizer(self.tokenizer, list(prompt_token_ids), skip)
        state = _RequestState(
            request_id, prompt, list(prompt_token_ids), sampling_params, detok,
            logprobs=[] if sampling_params.logprobs is not None else None,
            cumulative_logprob=0.0 if sampling_params.logprobs is not None else None,
            num_prior_tokens=len(prior), continues_elsewhere=continues_elsewhere,
        )
        if prior and detok is not None:
            # Replay the prefill leg's step: what it streamed counts as emitted (for stop-string
            # positions) but is not streamed again; what it held stays held here. It cannot have
            # matched a whole stop string: that leg would have finished with "stop" instead.
            self._apply_stop_strings(state, self._detokenize(state, prior, 0))
            state.chunks.clear()
        self._active[request_id] = state

    def abort_request(self, request_id: str) -> None:
        """Forget a request (client gone); later outputs for it are ignored."""
        self._active.pop(request_id, None)
        self._finished.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._active)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._active)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """One engine step: (one delta RequestOutput per known request, ids stopped here by a stop
        string that the engine must abort)."""
        request_outputs: list[RequestOutput] = []
        stopped: list[str] = []
        for out in outputs:
            state = self._active.get(out.request_id)
            if state is None:  # unknown, aborted, or already stopped by a stop string
                continue
            if len(out.new_token_ids) > 1 and state.params.stop and state.detokenizer is not None:
                delta_text, out = self._update_by_token(state, out)
            else:
                delta_text = self._update(state, out)
            if state.finished and not out.finished:
                stopped.append(state.request_id)
            request_outputs.append(self._make_output(state, delta_text, out.new_token_ids, out.new_logprobs,
                                                     out.prompt_logprobs))
            if state.finished:
                del self._active[state.request_id]
                if self.keep_finished:
                    self._finished[state.request_id] = state
        return request_outputs, stopped

    process = process_outputs  # the name LLMEngine calls

    def get_final(self, request_id: str) -> RequestOutput:
        """Whole result: pops a finished request; a snapshot of an unfinished one."""
        state = self._finished.pop(request_id, None) or self._active.get(request_id)
        if state is None:
            raise KeyError(f"unknown request {request_id!r}")
        return self._make_output(state, "".join(state.chunks), state.token_ids, state.logprobs or [],
                                 state.prompt_logprobs)

    # -- per step -----------------------------------------------------------------------------
    def _update_by_token(self, state: _RequestState, out: EngineCoreOutput) -> tuple[str, EngineCoreOutput]:
        """A step that brought several tokens (accepted drafts) to a request with stop strings:
        one token at a time, so that a stop string ends the output at the token that completed
        it, tokens and logprobs included, as when the tokens come one step at a time."""
        texts: list[str] = []
        num = len(out.new_token_ids)
        kept = 0
        for i in range(num):
            last = i == num - 1
            piece = dataclasses.replace(
                out, new_token_ids=out.new_token_ids[i:i + 1], new_logprobs=out.new_logprobs[i:i + 1],
                prompt_logprobs=out.prompt_logprobs if i == 0 else None,
                finish_reason=out.finish_reason if last else None, stop_reason=out.stop_reason if last else None,
                error=out.error if last else None, error_field=out.error_field if last else None,
                kv_transfer_params=out.kv_transfer_params if last else None)
            texts.append(self._update(state, piece))
            kept = i + 1
            if state.finished:
                break
        return "".join(texts), dataclasses.replace(out, new_token_ids=out.new_token_ids[:kept],
                                                   new_logprobs=out.new_logprobs[:kept])

    def _update(self, state: _RequestState, out: EngineCoreOutput) -> str:
        params = state.params
        if out.prompt_logprobs is not None:
            state.prompt_logprobs = out.prompt_logprobs
        num_before = state.num_prior_tokens + len(state.token_ids)
        state.token_ids.extend(out.new_token_ids)
        if state.logprobs is not None and out.new_logprobs:
            state.logprobs.extend(out.new_logprobs)
            step_logprob = sum(lp.sampled.logprob for lp in out.new_logprobs)
            state.cumulative_logprob = (state.cumulative_logprob or 0.0) + step_logprob
        if out.num_cached_tokens:
            state.num_cached_tokens = out.num_cached_tokens
        if out.kv_transfer_params is not None:
            state.kv_transfer_params = out.kv_transfer_params
        if out.finished:
            state.finish_reason, state.stop_reason = out.finish_reason, out.stop_reason
            state.error, state.error_field = out.error, out.error_field
        if state.detokenizer is None:
            return ""
        text_ids = out.new_token_ids
        if out.finish_reason == "stop" and text_ids and not params.include_stop_str_in_output:
            text_ids = text_ids[:-1]  # the eos / stop token ends the request but is not text
        new_text = self._detokenize(state, text_ids, num_before)
        if out.finished and not state.handing_off:
            new_text += state.detokenizer.finish()
        return self._apply_stop_strings(state, new_text)

    def _detokenize(self, state: _RequestState, ids: list[int], num_before: int) -> str:
        detok = state.detokenizer
        assert detok is not None
        min_tokens = state.params.min_tokens
        if not state.params.stop or num_before + len(ids) <= min_tokens or num_before >= min_tokens:
            text = detok.add(ids)
            if num_before + len(ids) <= min_tokens:
                state.stop_floor = state.num_emitted_chars + len(state.held) + len(text)
            return text
        # This step crosses the min_tokens boundary: split it there to place the floor exactly.
        split = min_tokens - num_before
        head = detok.add(ids[:split])
        state.stop_floor = state.num_emitted_chars + len(state.held) + len(head)
        return head + detok.add(ids[split:])

    def _apply_stop_strings(self, state: _RequestState, new_text: str) -> str:
        stops = state.params.stop
        buf = state.held + new_text
        if not stops:
            state.held = ""
            return self._stream(state, buf)
        match = _find_stop(buf, stops, min_end=state.stop_floor - state.num_emitted_chars)
        if match is not None:
            start, stop = match
            end = start + len(stop) if state.params.include_stop_str_in_output else start
            state.held = ""
            state.finish_reason, state.stop_reason = "stop", stop
            return self._stream(state, buf[:end])
        if state.finished and not state.handing_off:
            state.held = ""
            return self._stream(state, buf)
        keep_from = _partial_stop_start(buf, stops)
        state.held = buf[keep_from:]
        return self._stream(state, buf[:keep_from])

    @staticmethod
    def _stream(state: _RequestState, text: str) -> str:
        if text:
            state.chunks.append(text)
            state.num_emitted_chars += len(text)
        return text

    def _make_output(
        self, state: _RequestState, text: str, token_ids: list[int], logprobs: list[SampleLogprobs],
        prompt_logprobs: list[SampleLogprobs] | None = None,
    ) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(token_ids),
            finish_reason=state.finish_reason,
            stop_reason=state.stop_reason,
            logprobs=list(logprobs) if state.logprobs is not None else None,
            cumulative_logprob=state.cumulative_logprob,
        )
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[completion],
            finished=state.finished,
            num_cached_tokens=state.num_cached_tokens,
            kv_transfer_params=state.kv_transfer_params,
            error=state.error,
            error_field=state.error_field,
            prompt_logprobs=list(prompt_logprobs) if prompt_logprobs is not None else None,
        )


def _find_stop(text: str, stops: tuple[str, ...], min_end: int) -> tuple[int, str] | None:
    """Earliest (then shortest) stop string in text that ends after index min_end."""
    best: tuple[int, int, str] | None = None
    for stop in stops:
        start = text.find(stop, max(0, min_end - len(stop) + 1))
        if start != -1 and (best is None or (start, len(stop)) < best[:2]):
            best = (start, len(stop), stop)
    return None if best is None else (best[0], best[2])


def _partial_stop_start(text: str, stops: tuple[str, ...]) -> int:
    """Earliest index i such that text[i:] is a proper prefix of some stop string (len(text) if
    none): text before i can be streamed, no future match can start there."""
    longest = max(len(s) for s in stops)
    first_chars = {s[0] for s in stops}  # cheap filter: most positions cannot start any stop string
    for i in range(max(0, len(text) - longest + 1), len(text)):
        if text[i] in first_chars and any(s.startswith(text[i:]) for s in stops):
            return i
    return len(text)
