"""LegRunner and the policy interface: the workers' block size is passed to the policy, never set on it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from pdcluster._proto import common_pb2
from pdcluster.router.config import RouterConfig
from pdcluster.router.legs import LegRunner
from pdcluster.router.policies import PrefixAware, RoundRobin, RoutingPolicy
from pdcluster.router.prefix_index import PrefixIndex
from pdcluster.router.preprocess import PreparedRequest
from pdcluster.router.request_state import RequestState


def _state(num_tokens: int) -> RequestState:
    prep = PreparedRequest("r", list(range(num_tokens)), common_pb2.SamplingParams(), max_tokens=4)
    return RequestState(prep, "grpc")


def _legs(policy: RoutingPolicy, infos: list[Any]) -> LegRunner:
    # Only first_info() is used to learn the block size; no worker is called here.
    registry = SimpleNamespace(first_info=lambda: infos[0] if infos else None)
    return LegRunner(RouterConfig(), registry, policy, metrics=None)  # type: ignore[arg-type]


def test_block_size_is_learned_from_the_workers_and_passed_in() -> None:
    calls: list[tuple[int, int]] = []

    def fake_hash(token_ids: list[int], block_size: int, salt: str | None) -> list[bytes]:
        calls.append((len(token_ids), block_size))
        return [bytes([i]) for i in range(len(token_ids) // block_size)]

    policy = PrefixAware(PrefixIndex(), hash_fn=fake_hash)
    infos: list[Any] = []
    legs = _legs(policy, infos)
    state = _state(40)
    assert legs.block_hashes(state) is None and state.block_hashes is None  # no worker said its size yet
    infos.append(SimpleNamespace(block_size=16))
    assert legs.block_hashes(state) == [b"\x00", b"\x01"] and legs.block_size() == 16
    assert legs.block_hashes(state) == [b"\x00", b"\x01"] and calls == [(40, 16)]  # once per request
    assert policy.block_size is None  # the router set nothing on the policy


def test_a_policy_that_routes_by_no_prefix_gets_no_hashes() -> None:
    legs = _legs(RoundRobin(), [SimpleNamespace(block_size=16)])
    state = _state(40)
    assert legs.block_hashes(state) is None and state.block_hashes is None
