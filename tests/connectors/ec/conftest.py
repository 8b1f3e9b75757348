"""Fixtures for the EC connector tests: a tiny random LLaVA checkpoint (made by transformers at
test time), CURVE keys made for the session, and engines with a p2p_ec connector that are always
shut down (their sockets, threads and shared memory released) when the test ends."""

from __future__ import annotations

import asyncio
import pathlib
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from models.llava_tiny import make_tiny_llava

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # ec_parts

from pdcluster.security.keys import KeyPair, generate_keypair, keypair_to_string


class ECKeys:
    def __init__(self) -> None:
        self.pairs: dict[str, KeyPair] = {n: generate_keypair(n) for n in ("encoder", "prefill", "other")}
        self.allowed = {n: kp.public.decode() for n, kp in self.pairs.items()}

    def options(self, name: str, **extra: Any) -> dict[str, Any]:
        return {"keypair": keypair_to_string(self.pairs[name]), "allowed_keys": self.allowed, **extra}


@pytest.fixture(scope="session")
def ec_keys() -> ECKeys:
    return ECKeys()


@pytest.fixture(scope="session")  # one checkpoint for every EC test module
def llava_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llava(tmp_path_factory.mktemp("llava-ec") / "ckpt", seed=4)


@pytest.fixture
def engines() -> Iterator[Any]:
    """make(path, **engine_args) -> AsyncEngine (ec_connector_factory wired in); all shut down after."""
    from pdcluster import AsyncEngine
    from pdcluster.config import EngineArgs
    from pdcluster.connectors import ec_connector_factory

    made: list[Any] = []

    def make(path: str, **kwargs: Any) -> Any:
        args = EngineArgs(model=path, num_kv_blocks=kwargs.pop("num_kv_blocks", 64), block_size=4,
                          device="cpu", **kwargs)
        engine = AsyncEngine.from_engine_args(args, ec_connector=ec_connector_factory if args.ec_connector else None)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.shutdown()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def collect(engine: Any, prompt: str, images: list, params: Any, ec: tuple = (), request_id: str | None = None
                  ) -> Any:
    """(token ids, final RequestOutput) of one request."""
    tokens: list[int] = []
    final = None
    async for out in engine.generate(prompt, params, request_id=request_id,
                                     multi_modal_data={"image": images} if images else None, ec_transfer_params=ec):
        tokens.extend(out.outputs[0].token_ids)
        final = out
    return tokens, final
