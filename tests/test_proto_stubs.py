"""The committed gRPC stubs (pdcluster/_proto/) are exactly what scripts/gen_proto.py makes from
proto/, and the protocol covers the Python contracts it mirrors."""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
STUB_DIR = ROOT / "pdcluster" / "_proto"


def _is_generated(name: str) -> bool:
    # Hand-written helpers may live beside the stubs; only protoc's outputs are compared.
    return name.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"))


def _load_gen_proto():
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_committed_stubs_are_fresh(tmp_path):
    pytest.importorskip("grpc_tools")
    fresh = {p.name: p.read_text() for p in _load_gen_proto().generate(tmp_path / "out")}
    committed = {p.name: p.read_text() for p in STUB_DIR.iterdir() if p.is_file() and _is_generated(p.name)}
    problems = []
    for name in sorted(set(fresh) - set(committed)):
        problems.append(f"missing stub {name}")
    for name in sorted(set(committed) - set(fresh)):
        problems.append(f"stub {name} has no .proto any more")
    for name in sorted(set(fresh) & set(committed)):
        if fresh[name] != committed[name]:
            diff = difflib.unified_diff(
                committed[name].splitlines(), fresh[name].splitlines(), "committed", "fresh", lineterm="", n=1
            )
            problems.append(f"stale stub {name}:\n" + "\n".join(list(diff)[:20]))
    assert not problems, "run `.venv/bin/python scripts/gen_proto.py`:\n" + "\n".join(problems)


def test_stubs_import_and_services_exist():
    from pdcluster._proto import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

    router = router_pb2.DESCRIPTOR.services_by_name["Router"]
    assert {m.name for m in router.methods} == {"Generate", "Abort", "ListWorkers"}
    assert router.methods_by_name["Generate"].server_streaming
    worker = worker_pb2.DESCRIPTOR.services_by_name["Worker"]
    assert {m.name for m in worker.methods} == {"Generate", "GenerateStream", "Abort", "Stats", "GetInfo", "Drain",
                                                 "Encode", "ProvideKVParams"}
    assert worker.methods_by_name["Generate"].server_streaming
    stream = worker.methods_by_name["GenerateStream"]
    assert stream.client_streaming and stream.server_streaming
    assert hasattr(router_pb2_grpc, "RouterStub") and hasattr(worker_pb2_grpc, "add_WorkerServicer_to_server")
    assert common_pb2.KvTransferParams.DESCRIPTOR.fields_by_name["extra"].message_type.GetOptions().map_entry


def test_kvstore_master_methods():
    from pdcluster._proto import kvstore_pb2

    master = kvstore_pb2.DESCRIPTOR.services_by_name["KVStoreMaster"]
    assert {m.name for m in master.methods} == {
        "PutStart", "PutEnd", "PutRevoke", "ReserveArena", "CommitArena", "ReleaseArena", "GetReplicas", "Exists",
        "BatchExists", "Remove", "MountSegment", "UnmountSegment", "Heartbeat", "Stats", "FollowOpLog", "AckOpLog",
        "GetRole", "OpenLookup"}
    assert master.methods_by_name["FollowOpLog"].server_streaming  # the standby's op-log feed


def test_sampling_params_message_mirrors_dataclass():
    from pdcluster._proto import common_pb2
    from pdcluster.proto_convert import ENGINE_ONLY_FIELDS
    from pdcluster.sampling_params import SamplingParams

    fields = common_pb2.SamplingParams.DESCRIPTOR.fields_by_name
    py_fields = {f.name: f for f in dataclasses.fields(SamplingParams)
                 if f.name != "extra" and f.name not in ENGINE_ONLY_FIELDS}
    assert set(fields) == set(py_fields), "proto SamplingParams and the dataclass differ"
    for name, f in fields.items():
        is_list = f.is_repeated
        # Every scalar must distinguish "unset" (take the dataclass default) from zero.
        assert is_list or f.has_presence, f"SamplingParams.{name} must be `optional`"


def test_oneofs_and_presence():
    from pdcluster._proto import common_pb2, router_pb2, worker_pb2

    req = router_pb2.GenerateRequest(prompt="hi")
    req.prompt_token_ids.ids.extend([1, 2])
    assert req.WhichOneof("input") == "prompt_token_ids"  # exactly one input kind
    sp = common_pb2.SamplingParams(temperature=0.0)
    assert sp.HasField("temperature") and not sp.HasField("top_p")
    w = worker_pb2.WorkerGenerateRequest()
    assert not w.HasField("kv_transfer_params")
    w.kv_transfer_params.do_remote_decode = True
    assert w.HasField("kv_transfer_params")
    data = w.SerializeToString()
    assert worker_pb2.WorkerGenerateRequest.FromString(data) == w


def test_standard_health_service_available():
    from grpc_health.v1 import health, health_pb2

    servicer = health.HealthServicer()
    servicer.set("pdcluster.v1.Router", health_pb2.HealthCheckResponse.SERVING)
