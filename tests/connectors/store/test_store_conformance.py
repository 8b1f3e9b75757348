"""The connector conformance kit on the store connector (in-process engines, a real kvstore)."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from pdcluster.connectors.testing import ConnectorConformance


class TestStoreConformance(ConnectorConformance):
    connector_name = "store"
    master: str = ""

    @pytest.fixture(scope="class", autouse=True)
    def _store(self, kvstore_master: str) -> None:
        type(self).master = kvstore_master

    def make_options(self, role: str, workdir: pathlib.Path) -> dict[str, Any]:
        # The kit's consumers pass failure_policy themselves; the store's default is "recompute".
        return {"master": type(self).master, "namespace": "conformance"}

    def test_decode_leg_loads_prefill_blocks_from_store(self, env: Any) -> None:
        from pdcluster.sampling_params import SamplingParams

        prompts = self.prompts(env, seed=11)  # 3, 16, 17, 40 tokens
        params = [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)] * len(prompts)
        consumer = env.consumers["fail"]
        before = consumer.get_stats()["kv_connector"]["store_hit_tokens"]
        self.check_equal(env, "loaded", prompts, params)
        # Each decode leg (prompt + the prefill's token) loads its full prompt blocks: 0+16+16+32.
        assert consumer.get_stats()["kv_connector"]["store_hit_tokens"] - before == 64
