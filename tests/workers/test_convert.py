"""Pure pieces of the worker service: proto <-> engine conversion, roles, the hit-rate window."""

from __future__ import annotations

import pytest

from pdcluster import proto_convert
from pdcluster._proto import common_pb2, worker_pb2
from pdcluster.decode_worker import DecodeRole
from pdcluster.engine.kv_connector import KVTransferParams
from pdcluster.engine.outputs import CompletionOutput, Logprob, RequestOutput, SampleLogprobs
from pdcluster.prefill_worker import PrefillRole
from pdcluster.sampling_params import SamplingParams
from pdcluster.worker import convert
from pdcluster.worker.roles import AggregatedRole, KvTransferRejected
from pdcluster.worker.worker_stats import HitRateWindow


def test_unset_fields_keep_defaults() -> None:
    assert convert.sampling_params_from_proto(common_pb2.SamplingParams()) == SamplingParams()
    assert convert.sampling_params_from_proto(None) == SamplingParams()


def test_zero_is_not_unset() -> None:
    sp = convert.sampling_params_from_proto(common_pb2.SamplingParams(temperature=0.0, top_k=-1, seed=0))
    assert sp.temperature == 0.0 and sp.top_k == 0 and sp.seed == 0


def test_roundtrip() -> None:
    sp = SamplingParams(temperature=0.3, top_p=0.9, top_k=5, seed=7, stop=["\n\n"], stop_token_ids=[3],
                        max_tokens=33, logprobs=2, skip_special_tokens=False, ignore_eos=True, min_tokens=1)
    assert convert.sampling_params_from_proto(convert.sampling_params_to_proto(sp)) == sp


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1.0}, "temperature"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -3}, "top_k"), ({"seed": 2**63}, "seed"), ({"n": 17}, "n"), ({"logprobs": 99}, "logprobs"),
])
def test_invalid_values_name_the_field(kwargs, field: str) -> None:
    with pytest.raises(ValueError, match=f"sampling_params.{field}"):
        convert.sampling_params_from_proto(common_pb2.SamplingParams(**kwargs))


def test_one_conversion_module() -> None:
    # The worker's names are the core module's (the router and the client use it too).
    for name in ("sampling_params_from_proto", "sampling_params_to_proto", "kv_params_from_proto",
                 "kv_params_to_proto", "FINISH_REASON_TO_PROTO", "ROLE_TO_PROTO"):
        assert getattr(convert, name) is getattr(proto_convert, name), name


def test_conversion_module_is_torch_free() -> None:
    import subprocess
    import sys

    code = ("import sys, pdcluster.proto_convert, router.convert; "
            "assert not [m for m in sys.modules if m.split('.')[0] in ('torch', 'triton')], 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]


def test_kv_params_roundtrip_and_extra() -> None:
    msg = common_pb2.KvTransferParams(do_remote_prefill=True, producer_id="p0", block_ids=[4, 5], num_tokens=20,
                                      producer_public_key=b"k" * 40, extra={"x": "1"})
    d = convert.kv_params_from_proto(msg)
    assert d.block_ids == (4, 5) and d.extra == {"x": "1"} and d.lease_id == ""
    assert convert.kv_params_to_proto(d) == msg
    # A plugin connector's private values survive the trip through the router, with their types.
    assert convert.kv_params_to_proto(KVTransferParams(extra={"plugin_key": "3"})).extra["plugin_key"] == "3"
    typed = KVTransferParams(extra={"plugin_key": 3, "blob": b"\x00", "ids": [1, "a", b"z"], "ok": True, "f": 0.5})
    assert convert.kv_params_from_proto(convert.kv_params_to_proto(typed)) == typed


def test_kv_params_from_proto_refuses_malformed_extra_by_name() -> None:
    with pytest.raises(ValueError, match=r"extra\['n'\]"):
        convert.kv_params_from_proto(common_pb2.KvTransferParams(extra={"n:mp": "not base64!"}))
    with pytest.raises(ValueError, match="keys must match"):
        convert.kv_params_from_proto(common_pb2.KvTransferParams(extra={"a b": "1"}))


def _out(tokens, text, finished=False, reason=None, stop=None, error=None, logprobs=None) -> RequestOutput:
    return RequestOutput("r", None, [1, 2, 3], [CompletionOutput(0, text, tokens, reason, stop, logprobs)],
                         finished, num_cached_tokens=2, error=error)


def test_output_to_response_final_fields() -> None:
    lp = [SampleLogprobs(Logprob(7, -0.1, 1), [Logprob(7, -0.1, 1), Logprob(8, -2.0, 2)])]
    resp = convert.output_to_response(_out([7], "a", True, "stop", 7, logprobs=lp), arrival_time=5.0,
                                      num_completion_tokens=4, token_text=lambda t: f"<{t}>")
    assert resp.finished and resp.finish_reason == common_pb2.FINISH_REASON_STOP and resp.stop_token_id == 7
    assert resp.usage == common_pb2.Usage(prompt_tokens=3, completion_tokens=4, cached_tokens=2)
    assert resp.logprobs[0].top[1].decoded == "<8>" and list(resp.token_arrival_times) == [5.0]
    err = convert.output_to_response(_out([], "", True, "error", error="boom"), arrival_time=0, num_completion_tokens=0)
    assert err.finish_reason == common_pb2.FINISH_REASON_ERROR and err.error_message == "boom"
    mid = convert.output_to_response(_out([1, 2], "xy"), arrival_time=1.0, num_completion_tokens=2)
    assert not mid.finished and not mid.HasField("usage") and mid.WhichOneof("stop_reason") is None


def test_merge_responses() -> None:
    parts = [worker_pb2.WorkerGenerateResponse(request_id="r", token_ids=[1], text="a"),
             worker_pb2.WorkerGenerateResponse(request_id="r", token_ids=[2], text="b", finished=True,
                                               finish_reason=common_pb2.FINISH_REASON_STOP, stop_str="b",
                                               usage=common_pb2.Usage(completion_tokens=2))]
    m = convert.merge_responses(parts)
    assert list(m.token_ids) == [1, 2] and m.text == "ab" and m.stop_str == "b" and m.usage.completion_tokens == 2


PRODUCER = KVTransferParams(do_remote_decode=True)
CONSUMER = KVTransferParams(do_remote_prefill=True, producer_id="p", num_tokens=16)


@pytest.mark.parametrize("role_cls", [PrefillRole, DecodeRole, AggregatedRole])
def test_roles_without_connector(role_cls) -> None:
    role = role_cls()
    assert role.accept(None) is None and role.accept(KVTransferParams()) is None
    for kv in (PRODUCER, CONSUMER):
        with pytest.raises(KvTransferRejected, match="no KV connector"):
            role.accept(kv)
    with pytest.raises(ValueError, match="exclusive"):
        role.accept(KVTransferParams(do_remote_decode=True, do_remote_prefill=True))
    with pytest.raises(ValueError, match="do_remote"):
        role.accept(KVTransferParams(producer_id="p"))


def test_roles_with_connector() -> None:
    assert PrefillRole("p2p").accept(PRODUCER) == PRODUCER
    assert DecodeRole("p2p").accept(CONSUMER) == CONSUMER
    both = AggregatedRole("p2p")
    assert both.accept(PRODUCER) == PRODUCER and both.accept(CONSUMER) == CONSUMER
    with pytest.raises(KvTransferRejected, match="does not serve decode legs"):
        PrefillRole("p2p").accept(CONSUMER)
    with pytest.raises(KvTransferRejected, match="does not serve prefill legs"):
        DecodeRole("p2p").accept(PRODUCER)
    with pytest.raises(KvTransferRejected, match="connector is 'store'"):
        DecodeRole("p2p").accept(CONSUMER.replace(connector="store"))
    with pytest.raises(ValueError, match="producer_id"):
        DecodeRole("p2p").accept(KVTransferParams(do_remote_prefill=True, num_tokens=3))
    with pytest.raises(ValueError, match="num_tokens"):
        DecodeRole("p2p").accept(KVTransferParams(do_remote_prefill=True, producer_id="p", num_tokens=-1))


def test_hit_rate_window() -> None:
    now = [0.0]
    w = HitRateWindow(window_s=10.0, clock=lambda: now[0])
    assert w.update(0, 0) == 0.0
    now[0] = 5.0
    assert w.update(100, 100) == 1.0
    now[0] = 30.0  # the early all-hit traffic left the window: only the recent misses count
    assert w.update(200, 100) == pytest.approx(0.0)
    now[0] = 100.0  # no traffic in the window: the lifetime rate
    assert w.update(200, 100) == pytest.approx(0.5)
