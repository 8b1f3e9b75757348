"""Conformance kit for encoder-cache (EC) connectors: point it at your connector and run pytest.

    # tests/test_my_ec_connector.py
    from pdcluster.connectors.testing import ECConnectorConformance

    class TestMine(ECConnectorConformance):
        connector_name = "mine"                  # registry name, entry point, or "pkg.mod:Class"
        options = {"dir": "/tmp/x"}              # ec_connector_options for every instance
        lease_options = {"lease_s": 0.5}         # producer options making announce leases short (None: skip)
        not_ready_stat = "my_not_ready"          # a producer get_stats() counter of NOT_READY answers (optional)
        short_fetch_options = {"fetch_timeout_s": 0.5}   # consumer options: a short NOT_READY deadline (None: skip)

        def make_options(self, role, workdir):   # role "producer" | "consumer"; optional
            return {**self.options, "role": role, "dir": str(workdir)}

It drives the contract (pdcluster/engine/ec_connector.py) the way the engine does, without an
engine or weights: instances are built `cls(ECConnectorRole.WORKER, engine_config, options)` through
the EC registry, on the engine config of a tiny LLaVA (a config.json the kit writes, or `model`),
with (num_tokens, text hidden) tensors in the model dtype as encoder outputs. It checks:

  - states: ABSENT -reserve-> PENDING -save-> READY; request_finished leases READY items only
    (PINNED), a PENDING or unknown item is never announced; the params survive the proto a router
    carries them in;
  - fetch of a saved item: build_load_meta plans exactly the listed features, start_load returns
    the very tensor (values, shape, dtype), and the consumer's release ends the lease (READY again);
  - NOT_READY vs MISSING: a PENDING item asked for is waited on and served once saved (retryable),
    one still PENDING at the fetch deadline fails as NOT_READY_TIMEOUT (short_fetch_options), a
    never-held item fails as MISSING, never as a not-ready timeout;
  - refusal of garbage params (an unknown producer key, another encoder's fingerprint, a broken
    address, an item the producer never had): each fails alone in the report's `failed` with an
    ECFetchError, the future never raises, and the next good fetch still works;
  - an announce lease nobody consumes ends by itself (lease_options);
  - shutdown: idempotent, leaves no thread, no shared memory it mapped (unmapped and unlinked)
    and no listening endpoint.

Waits are for events, each bounded by `wait_s` only to stop a hung test: no check depends on how
fast the machine is.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any, ClassVar

import pytest

from pdcluster.config import EngineArgs, EngineConfig
from pdcluster.engine.ec_connector import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
    ECFetchError,
    ECItemState,
    ECLoadReport,
)
from pdcluster.engine.ec_transfer_params import ECItemRef, ECTransferParams
from pdcluster.engine.mm_inputs import MultiModalFeature

from ..registry import EC_CONNECTORS, create_ec_connector

NUM_TOKENS = 16  # rows of one encoder output (the placeholders of one image)


def tiny_llava_config() -> dict[str, Any]:
    """A tiny LLaVA (CLIP 32 px / patch 8 -> 16 placeholders, Llama decoder hidden 64): config only."""
    return {
        "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "dtype": "float32",
        "image_token_index": 383, "projector_hidden_act": "gelu", "multimodal_projector_bias": True,
        "tie_word_embeddings": False, "vision_feature_layer": -2, "vision_feature_select_strategy": "default",
        "text_config": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "head_dim": 16,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
                        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "vocab_size": 384,
                        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "tie_word_embeddings": False},
        "vision_config": {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                          "num_attention_heads": 4, "num_hidden_layers": 3, "image_size": 32, "patch_size": 8,
                          "projection_dim": 32, "num_channels": 3, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5},
    }


def write_tiny_llava_config(path: pathlib.Path) -> str:
    """A LLaVA 'checkpoint' with a config and an empty safetensors file: enough for an EngineConfig
    (connectors read the config and fingerprint the encoder; nothing here loads weights)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(tiny_llava_config()), encoding="utf-8")
    header = b"{}      "  # safetensors: u64 header length + a JSON header of no tensors
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    return str(path)


def wait_for(cond: Callable[[], bool], what: str, timeout_s: float) -> None:
    """Wait for an event; the deadline only stops a hung test (never a speed assertion)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.005)


class ECConformanceEnv:
    """The model, engine config and the connectors one conformance class runs against."""

    def __init__(self, kit: ECConnectorConformance, workdir: pathlib.Path) -> None:
        self.kit, self.workdir = kit, workdir
        self.model = kit.model or write_tiny_llava_config(workdir / "tiny-llava")
        self.engine_config: EngineConfig = EngineArgs(
            model=self.model, num_kv_blocks=64, block_size=4, device="cpu").create_engine_config()
        self.made: list[ECConnectorBase] = []
        self._count = 0
        self.producer = self.connector("producer")
        self.consumer = self.connector("consumer")

    def connector(self, role: str, **extra: Any) -> ECConnectorBase:
        options = {**self.kit.make_options(role, self.workdir), **extra}
        conn = create_ec_connector(self.kit.connector_name, ECConnectorRole.WORKER, self.engine_config, options)
        self.made.append(conn)
        return conn

    def new_hash(self) -> str:
        self._count += 1
        return hashlib.sha256(f"ec-conformance-{os.getpid()}-{self._count}".encode()).hexdigest()

    def output(self, seed: int) -> Any:
        import torch

        from pdcluster.dtypes import torch_dtype
        from pdcluster.models.llava_config import load_llava_vision_config

        hidden = load_llava_vision_config(self.model).text_hidden_size
        g = torch.Generator().manual_seed(seed)
        return torch.randn(NUM_TOKENS, hidden, generator=g).to(torch_dtype(self.engine_config.model.dtype))

    def close(self) -> None:
        for c in self.made:
            c.shutdown()


def feature(mm_hash: str) -> MultiModalFeature:
    return MultiModalFeature(mm_hash, offset=0, length=NUM_TOKENS, pixel_values=None)


class ECConnectorConformance:
    connector_name: ClassVar[str] = ""
    options: ClassVar[dict[str, Any]] = {}
    producer_options: ClassVar[dict[str, Any]] = {}
    consumer_options: ClassVar[dict[str, Any]] = {}
    lease_options: ClassVar[dict[str, Any] | None] = None
    short_fetch_options: ClassVar[dict[str, Any] | None] = None
    not_ready_stat: ClassVar[str | None] = None
    wait_s: ClassVar[float] = 60.0
    model: ClassVar[str | None] = None

    def make_options(self, role: str, workdir: pathlib.Path) -> dict[str, Any]:
        extra = self.producer_options if role == "producer" else self.consumer_options
        return {**self.options, **extra}

    @pytest.fixture(scope="class")
    def ec_env(self, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ECConformanceEnv]:
        if not self.connector_name:
            pytest.skip("set connector_name on the ECConnectorConformance subclass")
        env = ECConformanceEnv(self, tmp_path_factory.mktemp("ec-conformance"))
        yield env
        env.close()

    # -- helpers ---------------------------------------------------------------------------------
    def saved(self, env: ECConformanceEnv, producer: ECConnectorBase | None = None) -> tuple[str, Any, ECTransferParams]:
        """A fresh item reserved, saved and announced: (mm_hash, tensor, params)."""
        producer = producer or env.producer
        h = env.new_hash()
        out = env.output(env._count)
        producer.reserve([h])
        producer.save(h, out)
        params = producer.request_finished(f"req-{h[:8]}", [h])
        assert params is not None and params.item(h) is not None, f"request_finished did not announce a saved item: {params}"
        return h, out, params

    def load(self, env: ECConformanceEnv, params: tuple[ECTransferParams, ...], hashes: list[str]) -> ECLoadReport:
        meta = env.consumer.build_load_meta("load", [feature(h) for h in hashes], params)
        assert isinstance(meta, ECConnectorMetadata)
        report = env.consumer.start_load(meta).result(timeout=self.wait_s)  # never raises (contract)
        assert isinstance(report, ECLoadReport)
        return report

    def wait_unpinned(self, env: ECConformanceEnv, producer: ECConnectorBase, h: str, what: str) -> None:
        wait_for(lambda: producer.item_state(h) != ECItemState.PINNED, what, self.wait_s)
        assert producer.item_state(h) in (ECItemState.READY, ECItemState.EVICTED, ECItemState.ABSENT)

    # -- the checks ------------------------------------------------------------------------------
    def test_resolves_by_name(self) -> None:
        cls = EC_CONNECTORS.get(self.connector_name)
        assert isinstance(cls, type) and issubclass(cls, ECConnectorBase)

    def test_item_states_and_announce_only_when_servable(self, ec_env: ECConformanceEnv) -> None:
        from pdcluster.proto_convert import ec_params_from_proto, ec_params_to_proto

        p = ec_env.producer
        assert p.is_producer, "a producer instance must say is_producer (the engine saves only then)"
        h, pending, unknown = ec_env.new_hash(), ec_env.new_hash(), ec_env.new_hash()
        assert p.item_state(h) == ECItemState.ABSENT
        p.reserve([h, pending])
        assert p.item_state(h) == ECItemState.PENDING
        p.save(h, ec_env.output(1))
        assert p.item_state(h) == ECItemState.READY
        assert p.request_finished("none", [unknown]) is None, "nothing held: request_finished must return None"
        params = p.request_finished("r", [h, pending, unknown])
        assert isinstance(params, ECTransferParams)
        assert [i.mm_hash for i in params.items] == [h], f"only READY items may be announced: {params.items}"
        assert p.item_state(h) == ECItemState.PINNED, "an announced item is held under a lease"
        assert p.item_state(pending) == ECItemState.PENDING
        assert ec_params_from_proto(ec_params_to_proto(params)) == params, "params must survive the proto"
        assert p.endpoint() is None or (isinstance(p.endpoint()[0], str) and isinstance(p.endpoint()[1], bytes))

    def test_fetch_of_a_saved_item_and_lease_release(self, ec_env: ECConformanceEnv) -> None:
        h, out, params = self.saved(ec_env)
        other = ec_env.new_hash()  # a feature the params do not list: never planned
        meta = ec_env.consumer.build_load_meta("r", [feature(h), feature(other)], (params,))
        assert [ld.mm_hash for ld in meta.loads] == [h]
        report = ec_env.consumer.start_load(meta).result(timeout=self.wait_s)
        assert not report.failed, f"a saved, announced item failed: {report.failed}"
        got = report.loaded[h]
        assert got.dtype == out.dtype and tuple(got.shape) == tuple(out.shape) and bool((got == out).all())
        self.wait_unpinned(ec_env, ec_env.producer, h, "the consumer to release the lease after its fetch")

    def test_not_ready_is_retried_and_missing_is_not(self, ec_env: ECConformanceEnv) -> None:
        import concurrent.futures as cf

        _, _, known = self.saved(ec_env)  # for the producer's address and key
        h, missing = ec_env.new_hash(), ec_env.new_hash()
        out = ec_env.output(7)
        ec_env.producer.reserve([h])  # the tower is running
        asked = replace(known, items=(ECItemRef(h),))
        with cf.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(self.load, ec_env, (asked,), [h])
            if self.not_ready_stat:
                wait_for(lambda: ec_env.producer.get_stats().get(self.not_ready_stat, 0) >= 1,
                         f"a NOT_READY answer ({self.not_ready_stat})", self.wait_s)
            ec_env.producer.save(h, out)
            report = fut.result(timeout=self.wait_s)
        assert not report.failed, f"a PENDING item then saved must be served (NOT_READY is retryable): {report.failed}"
        assert bool((report.loaded[h] == out).all())
        report = self.load(ec_env, (replace(known, items=(ECItemRef(missing),)),), [missing])
        assert report.failed.get(missing) == ECFetchError.MISSING, f"never held must be MISSING: {report.failed}"

    def test_never_saved_item_times_out_as_not_ready(self, ec_env: ECConformanceEnv) -> None:
        if self.short_fetch_options is None:
            pytest.skip("short_fetch_options not set: the NOT_READY deadline is not checked")
        _, _, known = self.saved(ec_env)
        h = ec_env.new_hash()
        ec_env.producer.reserve([h])  # PENDING for good: its encode never finishes
        consumer = ec_env.connector("consumer", **self.short_fetch_options)
        try:
            meta = consumer.build_load_meta("r", [feature(h)], (replace(known, items=(ECItemRef(h),)),))
            report = consumer.start_load(meta).result(timeout=self.wait_s)
        finally:
            consumer.shutdown()
        assert report.failed.get(h) == ECFetchError.NOT_READY_TIMEOUT, \
            f"still PENDING at the fetch deadline must be NOT_READY_TIMEOUT: {report.failed}"

    def test_garbage_params_fail_alone(self, ec_env: ECConformanceEnv) -> None:
        h, out, params = self.saved(ec_env)
        bad = {
            "untrusted key": replace(params, public_key=hashlib.sha256(b"stranger").digest()),
            "incompatible": replace(params, fingerprint="0" * 64),
            "broken address": replace(params, address="no-port-here"),
        }
        for what, p in bad.items():
            report = self.load(ec_env, (p,), [h])
            assert h not in report.loaded and isinstance(report.failed.get(h), ECFetchError), \
                f"{what}: must fail with an ECFetchError, got {report.failed}"
        empty = self.load(ec_env, (), [h])
        assert not empty.loaded and not empty.failed
        report = self.load(ec_env, (params,), [h])  # the connector is still healthy
        assert not report.failed and bool((report.loaded[h] == out).all())

    def test_unconsumed_lease_ends(self, ec_env: ECConformanceEnv) -> None:
        if self.lease_options is None:
            pytest.skip("lease_options not set: the connector's announce leases are not checked")
        producer = ec_env.connector("producer", **self.lease_options)
        try:
            h, _, _ = self.saved(ec_env, producer)
            assert producer.item_state(h) == ECItemState.PINNED
            self.wait_unpinned(ec_env, producer, h, "an unconsumed announce lease to end")
        finally:
            producer.shutdown()

    def test_shutdown_leaves_nothing(self, ec_env: ECConformanceEnv) -> None:
        threads = set(threading.enumerate())
        mapped = _mapped_shm()
        producer, consumer = ec_env.connector("producer"), ec_env.connector("consumer")
        h, out, params = self.saved(ec_env, producer)
        meta = consumer.build_load_meta("r", [feature(h)], (params,))
        report = consumer.start_load(meta).result(timeout=self.wait_s)
        assert not report.failed and bool((report.loaded[h] == out).all())
        ours = _mapped_shm() - mapped  # shared memory these two mapped (other processes' is not ours)
        endpoint = producer.endpoint()
        for c in (consumer, producer, consumer, producer):  # twice each: idempotent
            c.shutdown()
        wait_for(lambda: not [t for t in threading.enumerate() if t not in threads and t.is_alive()],
                 "the connectors' threads to end", self.wait_s)
        left = (ours & _mapped_shm()) | {p for p in ours if os.path.exists(p)}
        assert not left, f"shared memory still mapped or not unlinked after shutdown: {sorted(left)}"
        if endpoint is not None:
            wait_for(lambda: not _listening(endpoint[0]), f"the endpoint {endpoint[0]} to close", self.wait_s)


def _mapped_shm() -> set[str]:
    """/dev/shm files this process maps (from /proc/self/maps; empty where there is none)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return set()
    out = set()
    for line in lines:
        path = line.split(None, 5)[5] if len(line.split(None, 5)) == 6 else ""
        if path.startswith("/dev/shm/"):
            out.add(path.removesuffix(" (deleted)"))
    return out


def _listening(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
            return True
    except OSError:
        return False


__all__ = ["ECConformanceEnv", "ECConnectorConformance", "NUM_TOKENS", "feature", "tiny_llava_config", "wait_for",
           "write_tiny_llava_config"]
