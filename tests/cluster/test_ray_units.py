"""The Ray launcher's pure parts: worker flags, preflight refusals, the state file, the process
tree, the status table. No Ray cluster is started here."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from pdcluster.cluster import ray_head
from pdcluster.cluster.config import ClusterConfig
from pdcluster.cluster.ray_launcher import LaunchError, RayLauncher, _worker_argv
from pdcluster.cluster.ray_secrets import (
    ENV_CONNECTOR_OPTIONS,
    HOST_PLACEHOLDER,
    bind_host_into,
    cluster_secrets,
)
from pdcluster.cluster.ray_status import format_status
from pdcluster.cluster.worker_flags import worker_flag, worker_flag_actions


@pytest.fixture(autouse=True)
def state_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PDCLUSTER_STATE_DIR", str(tmp_path / "state"))
    return tmp_path / "state"


def test_worker_argv_carries_role_model_engine_and_tp() -> None:
    c = ClusterConfig.from_dict({"model": "/m", "pools": {"both": {"tp": 2, "engine": {"max_num_seqs": 8}}}})
    argv = _worker_argv(c, "both")
    assert argv[:4] == ["--role", "both", "--model", "/m"] and argv[4:6] == ["--max-num-seqs", "8"]
    assert argv[6:] == [worker_flag(worker_flag_actions(), "tp"), "2"]
    # The argv parses with serve-worker's own parser.
    import argparse

    from pdcluster.cluster.worker_cmd import add_serve_worker

    sub = argparse.ArgumentParser().add_subparsers()
    add_serve_worker(sub)
    ns = sub.choices["serve-worker"].parse_args(argv)
    assert ns.role == "both" and ns.max_num_seqs == 8 and ns.tp == 2


def test_connector_secrets_go_through_the_environment_not_argv() -> None:
    c = ClusterConfig.from_dict({"pools": {"prefill": {}, "decode": {}},
                                 "connector": {"name": "p2p", "options": {"num_streams": 2}}})
    argv = _worker_argv(c, "decode")
    assert argv[-2:] == [worker_flag(worker_flag_actions(), "connector"), "p2p"]
    assert not any("keypair" in a or "secret" in a for a in argv)
    found = cluster_secrets(c)
    try:
        env = bind_host_into(found.for_instance("decode-0"), "10.1.2.3")
        opts = json.loads(env[ENV_CONNECTOR_OPTIONS])
        assert opts["num_streams"] == 2 and opts["keypair"] == env["PDCLUSTER_WORKER_KEY"]
        assert opts["side_channel_bind"] == "tcp://10.1.2.3:*" and opts["data_host"] == "10.1.2.3"
        assert len(bytes.fromhex(opts["params_secret"])) == 32
        # Each instance has its own pair (issue 16 item 5), and every instance's key is allowed.
        assert sorted(opts["allowed_keys"]) == ["decode-0", "prefill-0"]
        assert opts["allowed_keys"]["decode-0"] == env["PDCLUSTER_WORKER_KEY"].split(",")[0]
        other = json.loads(found.for_instance("prefill-0")[ENV_CONNECTOR_OPTIONS])
        assert other["keypair"] != opts["keypair"] and other["params_secret"] == opts["params_secret"]
        assert HOST_PLACEHOLDER in found.worker_env[ENV_CONNECTOR_OPTIONS]  # filled by each actor
        # serve-worker itself accepts the options (names it knows, keys that parse).
        from pdcluster.connectors.p2p.options import _KNOWN

        assert set(opts) <= _KNOWN
    finally:
        shutil.rmtree(found.key_dir or "/nonexistent", ignore_errors=True)


def test_preflight_refuses_a_namespace_that_is_up(state_dir) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ray_head.write_state("busy", {"head_pid": sleeper.pid, "head_start": ray_head.process_start_time(sleeper.pid)})
        with pytest.raises(LaunchError, match="already up in namespace 'busy'"):
            RayLauncher(ClusterConfig.from_dict({"namespace": "busy"}))._preflight()
    finally:
        sleeper.kill()
        sleeper.wait()
    # A recorded head that is gone (or a recycled pid) does not block a new `up`.
    launcher = RayLauncher(ClusterConfig.from_dict({"namespace": "busy"}))
    worker_env, router_env = launcher._preflight()
    assert set(worker_env) == {"PDCLUSTER_WORKER_KEY", "PDCLUSTER_KV_EVENTS_ALLOWED"}
    assert "," in worker_env["PDCLUSTER_WORKER_KEY"] and "," not in router_env["worker"]
    assert os.stat(launcher._key_tmp).st_mode & 0o077 == 0  # generated keys: a private folder
    launcher.down()
    assert not os.path.exists(launcher._key_tmp or "/nonexistent")


def test_state_file_is_private_and_round_trips(state_dir) -> None:
    path = ray_head.write_state("ns1", {"ray_address": "10.0.0.1:6379", "head_pid": None})
    assert path.parent == state_dir and os.stat(path).st_mode & 0o777 == 0o600
    assert ray_head.read_state("ns1") == {"ray_address": "10.0.0.1:6379", "head_pid": None}
    ray_head.remove_state("ns1")
    assert ray_head.read_state("ns1") is None


def test_stop_local_head_takes_the_whole_tree() -> None:
    # A parent with a child (stand-ins for `ray start --block` and a Ray process it started).
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        for _ in range(100):
            if ray_head.descendants(parent.pid):
                break
            import time

            time.sleep(0.05)
        (child,) = ray_head.descendants(parent.pid)
        start = ray_head.process_start_time(parent.pid)
        assert ray_head.stop_local_head(parent.pid, start_time=start, grace_s=5)
        assert not ray_head.pid_alive(parent.pid) and not ray_head.pid_alive(child)
    finally:
        parent.kill()
        parent.wait()


def test_pid_alive_checks_the_start_time() -> None:
    me = os.getpid()
    assert ray_head.pid_alive(me) and ray_head.pid_alive(me, ray_head.process_start_time(me))
    assert not ray_head.pid_alive(me, 1.0)  # the same pid, another process: not ours


def test_with_pdeathsig_execs_the_same_program() -> None:
    out = subprocess.run(ray_head.with_pdeathsig([sys.executable, "-c", "import os; print(os.getpid())"]),
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip().isdigit()


def test_format_status_table() -> None:
    text = format_status({"namespace": "pd", "router": {"grpc": "127.0.0.1:1", "http": None, "policy": "round_robin"},
                          "instances": [{"name": "both-0", "role": "both", "node": "10.0.0.1", "address": "127.0.0.1:2",
                                         "healthy": True, "num_running": 1, "num_waiting": 0, "kv_usage": 0.25,
                                         "restarts": 1, "child_pid": 42}], "errors": []})
    assert "router gRPC 127.0.0.1:1, policy round_robin" in text
    assert "both-0" in text and "25.0" in text and " ok " in text
    assert " ec " not in text
    encoder = {"name": "encode-0", "role": "encode", "address": "127.0.0.1:3", "healthy": True,
               "ec_endpoint": "127.0.0.1:7000"}
    text = format_status({"namespace": "pd", "router": None, "instances": [encoder], "errors": []})
    assert "encode-0" in text and "ec 127.0.0.1:7000" in text
