"""Conformance kit for KV connectors: point it at your connector and run pytest. (Encoder-cache
connectors have theirs: `ECConnectorConformance`, importable from here, in connectors/ec/testing.py.)

    # tests/test_my_connector.py
    from pdcluster.connectors.testing import ConnectorConformance

    class TestMine(ConnectorConformance):
        connector_name = "mine"               # registry name, entry point, or "pkg.mod:Class"
        options = {"dir": "/tmp/x"}           # kv_connector_options for every engine
        lease_options = {"lease_ttl_s": 2.0}  # producer options making leases short (None: skip)

        def make_options(self, role, workdir):  # optional: per-role / per-run options
            return {**self.options, "dir": str(workdir)}

It builds, in this process, on the built-in demo model: a producer engine (kv_role "producer",
options + lease_options), two consumer engines (kv_role "consumer", failure_policy "fail" and
"recompute"), and a reference engine without a connector; then checks, like a router would
drive them (same request id on both legs, prefill with max_tokens=1 and do_remote_decode, decode
with the returned params, do_remote_prefill and the prefill's token):

  - hand-off: params (a KVTransferParams, unchanged by the trip through the proto a router
    carries them in) come back on the prefill's final output and the producer holds the blocks
    (delay_free) until the consumer is done; greedy and seeded-random outputs equal the
    reference's token for token;
  - leases: a hand-off nobody consumes is freed after the lease expires;
  - failures: a decode leg whose KV is gone ends with a clear error under "fail" and equals the
    reference under "recompute"; mismatched params never produce silently wrong tokens;
  - an abort while loading frees everything;
  - no leaks: after every check, neither engine holds a block or a request.

Your connector must accept options["failure_policy"] ("fail" | "recompute"), read the leg from
request.kv_transfer_params (do_remote_decode / do_remote_prefill) and return a KVTransferParams
from request_finished; what is your connector's own goes in its bounded `extra` map.
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Callable
from typing import Any, ClassVar

import pytest

from pdcluster.config import EngineArgs
from pdcluster.engine.kv_connector import KVTransferParams
from pdcluster.engine.llm_engine import LLMEngine
from pdcluster.engine.outputs import RequestOutput
from pdcluster.proto_convert import kv_params_from_proto, kv_params_to_proto
from pdcluster.sampling_params import SamplingParams

from .ec.testing import ECConnectorConformance  # the EC counterpart (connectors/ec/testing.py)
from .registry import engine_connector_factory, resolve_connector_class

PROMPT_LENGTHS = (3, 16, 17, 40)
MAX_TOKENS = 6
PREFILL_LEG = KVTransferParams(do_remote_decode=True)  # what a router sends the prefill leg


class ConformanceEnv:
    """The engines one conformance class runs against."""

    def __init__(self, kit: ConnectorConformance, workdir: pathlib.Path) -> None:
        from pdcluster.models.demo import ensure_demo_model

        self.model = kit.model or ensure_demo_model()
        self.engines: list[LLMEngine] = []
        self.reference = self._engine(None, "both", {})
        lease = kit.lease_options or {}
        self.producer = self._engine(kit.connector_name, "producer",
                                     {**kit.make_options("producer", workdir), **lease})
        self.consumers = {policy: self._engine(kit.connector_name, "consumer",
                                               {**kit.make_options("consumer", workdir), "failure_policy": policy})
                          for policy in ("fail", "recompute")}

    def _engine(self, name: str | None, role: str, options: dict[str, Any]) -> LLMEngine:
        args = EngineArgs(model=self.model, num_kv_blocks=96, max_model_len=256, block_size=16, seed=0,
                          enable_prefix_caching=name is not None, kv_connector=name, kv_role=role,
                          kv_connector_options=options or None)
        engine = LLMEngine.from_engine_args(args, connector=engine_connector_factory if name else None)
        self.engines.append(engine)
        return engine

    def close(self) -> None:
        for e in self.engines:
            e.shutdown()


def drive(engines: list[LLMEngine], until: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Step every engine with work until `until()`; fail the test after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not until():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        busy = False
        for e in engines:
            if e.has_unfinished_requests():
                e.step()
                busy = True
        if not busy:
            time.sleep(0.005)


Leg = tuple[str, list[int], SamplingParams, KVTransferParams | None, list[int] | None]


def decode_leg(out: RequestOutput) -> KVTransferParams:
    """The params a router sends the decode leg: the prefill's, with do_remote_prefill set."""
    assert isinstance(out.kv_transfer_params, KVTransferParams), \
        f"{out.request_id}: request_finished must return a KVTransferParams, got {type(out.kv_transfer_params)}"
    return out.kv_transfer_params.for_decode_leg()


def run_requests(engine: LLMEngine, reqs: list[Leg], others: list[LLMEngine],
                 timeout_s: float = 120.0) -> dict[str, RequestOutput]:
    """Add (request_id, prompt, params, kv_transfer_params, prefill tokens) and run them to the end."""
    done: dict[str, RequestOutput] = {}
    for request_id, prompt, sp, kv, prior in reqs:
        request, text = engine.prepare_request(prompt, sp, request_id, kv, prior)
        engine.add_prepared(request, text)
    pending = {r[0] for r in reqs}
    deadline = time.monotonic() + timeout_s
    while pending:
        if time.monotonic() > deadline:
            raise AssertionError(f"requests {sorted(pending)} did not finish in {timeout_s}s")
        for out in engine.step():
            if out.finished and out.request_id in pending:
                pending.discard(out.request_id)
                done[out.request_id] = engine.get_final(out.request_id)
        for e in others:
            if e.has_unfinished_requests():
                e.step()
    return done


def assert_idle(engine: LLMEngine, others: list[LLMEngine], name: str, timeout_s: float = 30.0) -> None:
    """Every block back in the pool and nothing held for a transfer (within timeout_s)."""
    drive([engine, *others], lambda: not engine.has_unfinished_requests(), timeout_s, f"{name} to go idle")
    stats = engine.get_stats()
    assert stats["num_held_for_transfer"] == 0, f"{name} still holds blocks for a transfer: {stats}"
    assert stats["num_waiting_for_remote_kv"] == 0, f"{name} still waits for remote KV: {stats}"
    assert stats["kv_blocks_used"] == 0, f"{name} leaked {stats['kv_blocks_used']} blocks: {stats}"


class ConnectorConformance:
    connector_name: ClassVar[str] = ""
    options: ClassVar[dict[str, Any]] = {}
    producer_options: ClassVar[dict[str, Any]] = {}
    consumer_options: ClassVar[dict[str, Any]] = {}
    lease_options: ClassVar[dict[str, Any] | None] = None
    lease_expiry_wait_s: ClassVar[float] = 30.0
    model: ClassVar[str | None] = None

    def make_options(self, role: str, workdir: pathlib.Path) -> dict[str, Any]:
        extra = self.producer_options if role == "producer" else self.consumer_options
        return {**self.options, **extra}

    @pytest.fixture(scope="class")
    def env(self, tmp_path_factory: pytest.TempPathFactory) -> Any:
        if not self.connector_name:
            pytest.skip("set connector_name on the ConnectorConformance subclass")
        environment = ConformanceEnv(self, tmp_path_factory.mktemp("conformance"))
        yield environment
        environment.close()

    # -- helpers ---------------------------------------------------------------------------------
    @staticmethod
    def prompts(env: ConformanceEnv, seed: int = 0) -> list[list[int]]:
        import random

        rng = random.Random(seed)
        vocab = env.reference.config.model.vocab_size
        return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENGTHS]

    def prefill(self, env: ConformanceEnv, tag: str, prompts: list[list[int]],
                params: list[SamplingParams]) -> dict[str, RequestOutput]:
        reqs: list[Leg] = [(f"{tag}-{i}", p, _one_token(sp), PREFILL_LEG, None)
                           for i, (p, sp) in enumerate(zip(prompts, params))]
        outs = run_requests(env.producer, reqs, [])
        for request_id, out in outs.items():
            assert out.error is None, f"prefill {request_id} failed: {out.error}"
            kv = out.kv_transfer_params
            assert kv is not None, f"prefill {request_id}: the producer returned no kv_transfer_params"
            assert isinstance(kv, KVTransferParams), f"prefill {request_id}: params must be a KVTransferParams"
            # A router carries them as the proto: what the decode leg gets must be what was returned.
            assert kv_params_from_proto(kv_params_to_proto(kv)) == kv, \
                f"prefill {request_id}: the params do not survive the proto unchanged: {kv}"
        held = env.producer.get_stats()["num_held_for_transfer"]
        assert held >= len(prompts), f"the producer freed blocks before any consumer read them (held={held})"
        return outs

    def decode(self, env: ConformanceEnv, consumer: LLMEngine, tag: str, prompts: list[list[int]],
               params: list[SamplingParams], pre: dict[str, RequestOutput]) -> dict[str, RequestOutput]:
        reqs: list[Leg] = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            out = pre[f"{tag}-{i}"]
            reqs.append((f"{tag}-{i}", p, sp, decode_leg(out), list(out.outputs[0].token_ids)))
        return run_requests(consumer, reqs, [env.producer])

    def check_equal(self, env: ConformanceEnv, tag: str, prompts: list[list[int]], params: list[SamplingParams],
                    consumer: str = "fail") -> None:
        ref = run_requests(env.reference, [(f"ref-{tag}-{i}", p, sp, None, None)
                                           for i, (p, sp) in enumerate(zip(prompts, params))], [])
        pre = self.prefill(env, tag, prompts, params)
        dec = self.decode(env, env.consumers[consumer], tag, prompts, params, pre)
        for i in range(len(prompts)):
            d = dec[f"{tag}-{i}"]
            assert d.error is None, f"decode {tag}-{i} failed: {d.error}"
            got = pre[f"{tag}-{i}"].outputs[0].token_ids + d.outputs[0].token_ids
            assert got == ref[f"ref-{tag}-{i}"].outputs[0].token_ids, f"{tag}-{i}: disaggregated != aggregated"
        self.check_no_leaks(env)

    def check_no_leaks(self, env: ConformanceEnv) -> None:
        others = list(env.consumers.values())
        assert_idle(env.producer, others, "producer")
        for policy, c in env.consumers.items():
            assert_idle(c, [env.producer], f"consumer ({policy})")

    # -- the checks ------------------------------------------------------------------------------
    def test_resolves_by_name(self) -> None:
        resolve_connector_class(self.connector_name)

    def test_greedy_handoff_equals_aggregated(self, env: ConformanceEnv) -> None:
        prompts = self.prompts(env)
        self.check_equal(env, "greedy", prompts, [_greedy()] * len(prompts))

    def test_seeded_handoff_equals_aggregated(self, env: ConformanceEnv) -> None:
        prompts = self.prompts(env, seed=1)
        params = [SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=MAX_TOKENS, ignore_eos=True)
                  for i in range(len(prompts))]
        self.check_equal(env, "seeded", prompts, params)

    def test_recompute_consumer_equals_aggregated(self, env: ConformanceEnv) -> None:
        prompts = self.prompts(env, seed=2)
        self.check_equal(env, "recompute-ok", prompts, [_greedy()] * len(prompts), consumer="recompute")

    def test_unconsumed_lease_expires_and_failures_follow_policy(self, env: ConformanceEnv) -> None:
        if self.lease_options is None:
            pytest.skip("lease_options not set: the connector has no expiring hand-off to check")
        prompts = self.prompts(env, seed=3)[:2]
        params = [_greedy()] * len(prompts)
        pre = self.prefill(env, "expire", prompts, params)
        # Nobody consumes: the producer must free every block once the leases expire.
        drive([env.producer], lambda: env.producer.get_stats()["num_held_for_transfer"] == 0,
              self.lease_expiry_wait_s, "the producer's leases to expire")
        assert_idle(env.producer, [], "producer")
        expiry = max(o.kv_transfer_params.lease_expiry_time if o.kv_transfer_params else 0.0 for o in pre.values())
        drive([env.producer], lambda: time.time() > expiry + 0.2, self.lease_expiry_wait_s,
              "the lease expiry time in the params")  # a connector that freed blocks early (a copy)
        # A decode leg whose KV is gone: a clear error under "fail"...
        failed = self.decode(env, env.consumers["fail"], "expire", prompts[:1], params[:1], pre)["expire-0"]
        assert failed.outputs[0].finish_reason == "error" and failed.error, "an expired hand-off must fail loudly"
        # ... and the aggregated tokens under "recompute".
        ref = run_requests(env.reference, [("ref-expire-1", prompts[1], params[1], None, None)], [])
        got = self.decode(env, env.consumers["recompute"], "expire", prompts, params, pre)["expire-1"]
        assert got.error is None, got.error
        assert pre["expire-1"].outputs[0].token_ids + got.outputs[0].token_ids == ref["ref-expire-1"].outputs[0].token_ids
        self.check_no_leaks(env)

    def test_mismatched_params_never_give_wrong_tokens(self, env: ConformanceEnv) -> None:
        a, b = self.prompts(env, seed=4)[2:4]
        pre = self.prefill(env, "mismatch", [a], [_greedy()])
        out = pre["mismatch-0"]
        kv = decode_leg(out)
        ref = run_requests(env.reference, [("ref-mismatch", b, _greedy(), None, None)], [])["ref-mismatch"]
        # Prompt b with a's params (and b's own first token): refused, or computed correctly.
        t0 = ref.outputs[0].token_ids[:1]
        got = run_requests(env.consumers["fail"], [("mismatch-0", b, _greedy(), kv, t0)], [env.producer])["mismatch-0"]
        if got.error is None:
            assert t0 + got.outputs[0].token_ids == ref.outputs[0].token_ids, "mismatched params produced wrong tokens"
        self.check_no_leaks(env)

    def test_abort_while_loading_frees_everything(self, env: ConformanceEnv) -> None:
        prompts = self.prompts(env, seed=5)[3:]
        pre = self.prefill(env, "abort", prompts, [_greedy()])
        out = pre["abort-0"]
        kv = decode_leg(out)
        consumer = env.consumers["fail"]
        request, text = consumer.prepare_request(prompts[0], _greedy(), "abort-0", kv, list(out.outputs[0].token_ids))
        consumer.add_prepared(request, text)
        consumer.step()  # admitted: allocated, load started (or finished already)
        consumer.abort(["abort-0"])
        self.check_no_leaks(env)


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _one_token(sp: SamplingParams) -> SamplingParams:
    return sp.replace(max_tokens=1, min_tokens=0)


__all__ = ["PREFILL_LEG", "ConformanceEnv", "ConnectorConformance", "ECConnectorConformance", "Leg", "assert_idle",
           "decode_leg", "drive", "run_requests"]
