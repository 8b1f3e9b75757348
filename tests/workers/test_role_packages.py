"""The role packages: each runs on its own, registers its WorkerRole, and checks its own legs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdcluster._proto import common_pb2
from pdcluster.decode_worker import DecodeRole
from pdcluster.prefill_worker import PrefillRole
from pdcluster.worker import convert
from pdcluster.worker.assembly import WorkerConfig, connector_options
from pdcluster.worker.role_registry import BUILTIN_ROLES, WorkerRole, resolve_role, worker_roles
from pdcluster.worker.roles import AggregatedRole


def _kv(**fields):
    """kv_transfer_params as the worker receives them (through the proto conversion)."""
    return convert.kv_params_from_proto(common_pb2.KvTransferParams(**fields))


@pytest.mark.parametrize("package", ["prefill_worker", "decode_worker", "encode_worker"])
def test_role_package_runs_on_its_own(package: str) -> None:
    out = subprocess.run([sys.executable, "-m", f"pdcluster.{package}", "--help"], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert f"python -m pdcluster.{package}" in out and "--kv-connector" in out and "--ec-connector" in out
    assert "--role" not in out  # the package fixes it


@pytest.mark.parametrize("name, handler, kv_role", [
    ("prefill", PrefillRole, "producer"), ("decode", DecodeRole, "consumer"), ("both", AggregatedRole, "both"),
])
def test_builtin_roles(name: str, handler: type, kv_role: str) -> None:
    role = resolve_role(name)
    assert role.name == name and role.kv_role == kv_role and role.needs_connector == (name != "both")
    made = role.make_handler("p2p")
    assert type(made) is handler and made.connector_name == "p2p"
    assert set(role.role_metrics({"num_running": 1, "other": 2})) <= {"num_running"}


def test_unknown_role_lists_what_exists() -> None:
    with pytest.raises(ValueError, match="unknown worker role 'vision'") as e:
        resolve_role("vision")
    for name in BUILTIN_ROLES:
        assert name in str(e.value)
    assert set(BUILTIN_ROLES) <= set(worker_roles().names())


def test_a_new_role_needs_no_core_change() -> None:
    # What a third package (an encoder-only worker) would do: define its WorkerRole.
    role = WorkerRole("both", AggregatedRole, kv_role="both")
    assert resolve_role("pdcluster.worker.role_registry:AGGREGATED").kv_role == role.kv_role
    with pytest.raises(ValueError, match="kv_role"):
        WorkerRole("encode", AggregatedRole, kv_role="encoder")
    with pytest.raises(ValueError, match="calls itself 'both'"):
        WorkerRole("encode", AggregatedRole, kv_role="producer").make_handler()


@pytest.mark.parametrize("field, value", [
    ("producer_id", "p0"), ("block_ids", [1, 2]), ("store_keys", ["k"]), ("num_tokens", 16),
    ("lease_id", "l1"), ("transfer_token", b"t"), ("remote_port", 9000),
])
def test_prefill_refuses_decode_leg_fields_by_name(field: str, value) -> None:
    with pytest.raises(ValueError, match=f"kv_transfer_params.{field}"):
        PrefillRole("p2p").accept(_kv(do_remote_decode=True, **{field: value}))


def test_prefill_accepts_its_leg() -> None:
    kv = _kv(do_remote_decode=True, connector="p2p", extra={"plugin": "1"})
    assert PrefillRole("p2p").accept(kv) == kv
    # The aggregated role keeps its behaviour: it passes a producer leg through unchecked.
    assert AggregatedRole("p2p").accept(_kv(do_remote_decode=True, producer_id="p0"))


def test_connector_options_need_a_connector() -> None:
    with pytest.raises(ValueError, match="without --kv-connector"):
        connector_options(WorkerConfig(role="prefill", kv_connector_options={"a": 1}), resolve_role("prefill"))
    assert connector_options(WorkerConfig(role="decode"), resolve_role("decode")) == {}
