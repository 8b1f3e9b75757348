"""What one benchmark request is (BenchRequest) and what the load generator saw of it (RequestResult).

Field meanings follow vLLM's benchmark (`SampleRequest`, `RequestFuncOutput`) so numbers can be
compared side by side; the names follow this project's vocabulary (`*_len`, `*_ids`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BenchRequest:
    """One request to send. `prompt` is text, or token ids for backends that accept them."""

    prompt: str | list[int]
    prompt_len: int  # tokens of the prompt, without the special tokens a server may add
    expected_output_len: int  # becomes max_tokens
    request_id: str = ""
    images: tuple[bytes, ...] = ()  # JPEG/PNG bytes (random-mm), sent as image_url parts after the text


@dataclass
class RequestResult:
    """Timings of one request, in seconds on the `time.perf_counter()` clock.

    Invariants for a successful request: `ttft > 0`, `latency >= ttft`, and `itl` holds one gap
    per streamed chunk after the first, so `ttft + sum(itl) == latency`.
    """

    prompt_len: int = 0
    success: bool = False
    generated_text: str = ""
    output_len: int | None = None  # from the server (usage / token ids); None: count the text
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0  # e2el: send to last chunk
    start_time: float = 0.0  # perf_counter() when the request was sent
    error: str = ""

    @property
    def end_time(self) -> float:
        return self.start_time + self.latency

    def chunk_times(self) -> list[float]:
        """Absolute arrival time of every streamed chunk (first token, then one per ITL gap)."""
        if not self.success:
            return []
        t = self.start_time + self.ttft
        times = [t]
        for gap in self.itl:
            t += gap
            times.append(t)
        return times
