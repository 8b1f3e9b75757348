"""The step broadcast's wire format and the config hand-off: exact round trips, and every
malformed message refused with the one error type (no pickle anywhere)."""

from __future__ import annotations

import msgpack
import pytest

from pdcluster.distributed.config_codec import engine_config_from_dict, engine_config_to_dict
from pdcluster.distributed.step_codec import (
    decode_control,
    encode_shutdown,
    encode_step,
    scheduler_output_from_dict,
    scheduler_output_to_dict,
)
from pdcluster.engine.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from pdcluster.sampling_params import SamplingParams
from pdcluster.security.envelope import MalformedMessage


def sample_output() -> SchedulerOutput:
    sp = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=123, stop=["x y"], stop_token_ids=[7],
                        max_tokens=9, logprobs=2, repetition_penalty=1.1, allowed_token_ids=[3, 1, 7],
                        bad_words=["no way"], bad_words_token_ids=[[4, 5], [6]])
    new = [NewRequestData("a", [1, 2, 3], [], sp, [4, 5], 0, (2,)),
           NewRequestData("b-resumed", [9] * 20, [11, 12], SamplingParams(), [1, 2], 16, ())]
    cached = [CachedRequestData("c", [8], 33), CachedRequestData("d", [], 40)]
    so = SchedulerOutput(new, cached, {"a": 3, "b-resumed": 6, "c": 4, "d": 1}, 14, {"gone", "also-gone"})
    so.scheduled_spec_token_ids = {"c": [17, 18, 19]}  # c checks three drafts after its last token
    return so


def test_scheduler_output_round_trip() -> None:
    so = sample_output()
    kind, back = decode_control(encode_step(so))
    assert kind == "step" and back == so
    assert back.scheduled_new_reqs[0].sampling_params.to_dict() == so.scheduled_new_reqs[0].sampling_params.to_dict()
    assert decode_control(encode_shutdown()) == ("shutdown", None)


def test_empty_step_round_trips() -> None:
    so = SchedulerOutput([], [], {}, 0)
    assert decode_control(encode_step(so))[1] == so


def test_connector_metadata_is_refused_not_pickled() -> None:
    so = sample_output()
    so.kv_connector_metadata = object()
    with pytest.raises(ValueError, match="kv_connector_metadata"):
        encode_step(so)


@pytest.mark.parametrize("mutate", [
    lambda d: d.pop("new"),
    lambda d: d["new"][0].__setitem__(1, "not a list"),
    lambda d: d["new"][0].__setitem__(5, True),
    lambda d: d["new"][0][3].__setitem__("temperature", -1.0),  # SamplingParams validation
    lambda d: d["new"][0][3].__setitem__("no_such_field", 1),
    lambda d: d["cached"].append(["x", [1]]),
    lambda d: d["sched"].__setitem__("a", "3"),
    lambda d: d.__setitem__("total", 1.5),
    lambda d: d.__setitem__("spec", [1, 2]),
    lambda d: d["spec"].__setitem__("c", ["17"]),
])
def test_malformed_scheduler_output_is_refused(mutate) -> None:
    d = scheduler_output_to_dict(sample_output())
    mutate(d)
    with pytest.raises(MalformedMessage):
        scheduler_output_from_dict(d)


@pytest.mark.parametrize("data", [
    b"", b"\xc1garbage", msgpack.packb([1, 2]), msgpack.packb({"v": 2, "kind": "step"}),
    msgpack.packb({"v": 1, "kind": "launch-missiles"}), msgpack.packb({"v": 1, "kind": "step", "step": []}),
    msgpack.packb(msgpack.ExtType(1, b"x")),
])
def test_malformed_control_message_is_refused(data: bytes) -> None:
    with pytest.raises(MalformedMessage):
        decode_control(data)


def test_engine_config_round_trip(tiny_ckpt) -> None:
    from pdcluster.config import EngineArgs

    config = EngineArgs(model=tiny_ckpt("llama"), num_kv_blocks=32, tensor_parallel_size=2).create_engine_config()
    assert config.model.rope_scaling is not None  # the llama3 rope items survive the trip
    wire = msgpack.unpackb(msgpack.packb(engine_config_to_dict(config)))
    assert engine_config_from_dict(wire) == config


def test_config_refuses_tp_that_does_not_divide_the_model(tiny_ckpt) -> None:
    from pdcluster.config import EngineArgs

    with pytest.raises(ValueError, match="num_attention_heads=4"):
        EngineArgs(model=tiny_ckpt("llama"), num_kv_blocks=32, tensor_parallel_size=3).create_engine_config()
    with pytest.raises(ValueError, match="tp_collective_timeout_s"):
        EngineArgs(model=tiny_ckpt("llama"), tp_collective_timeout_s=0).create_engine_config()
