"""The seam between the load generator and what it loads: one `request()` per benchmark request.

A backend measures one request end to end and reports it as a `RequestResult`; it never raises
for a failed request (the runner still guards against bugs). Implementations are imported lazily
so `--backend openai` never needs grpc and `--backend pdcluster` never needs aiohttp.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import TracebackType

from pdcluster.cluster.bench.request import BenchRequest, RequestResult

BACKENDS = ("pdcluster", "openai", "openai-chat")
DEFAULT_ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class BackendConfig:
    """What every request shares: where to send it and how to sample."""

    backend: str
    target: str  # full URL for the HTTP backends, HOST:PORT of the router for pdcluster
    model: str | None = None  # the model name put into each request (OpenAI `model`)
    ignore_eos: bool = False
    temperature: float = 0.0
    request_timeout: float = 6 * 3600.0  # vLLM's: long runs at saturation must not be cut short


class Backend(ABC):
    def __init__(self, config: BackendConfig) -> None:
        self.config = config

    async def start(self) -> None:  # noqa: B027 - an optional hook, not abstract
        """Open connections; called once before the first request."""

    async def close(self) -> None:  # noqa: B027 - an optional hook, not abstract
        """Release connections; called once after the last request."""

    @abstractmethod
    async def request(self, req: BenchRequest) -> RequestResult: ...

    async def __aenter__(self) -> Backend:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()


def make_backend(config: BackendConfig) -> Backend:
    if config.backend in ("openai", "openai-chat"):
        from pdcluster.cluster.bench.openai_backend import OpenAIBackend

        return OpenAIBackend(config, chat=config.backend == "openai-chat")
    if config.backend == "pdcluster":
        from pdcluster.cluster.bench.pdcluster_backend import PdclusterBackend

        return PdclusterBackend(config)
    raise ValueError(f"unknown --backend {config.backend!r}; choose one of {', '.join(BACKENDS)}")
