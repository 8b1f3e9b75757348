"""`pdcluster up --worker-threads` and `--disagg-mode` (issue 14): parsed like `serve`'s, with
the same defaults, and carried to the worker actors' environment and the router actor's spec.
No Ray is started."""

from __future__ import annotations

import argparse

import pytest

from pdcluster.cluster.config import ClusterConfig
from pdcluster.cluster.cpu_pinning import ENV_THREADS
from pdcluster.cluster.placement import InstancePlan, NodeInfo
from pdcluster.cluster.ray_launcher import RayLauncher, worker_threads
from pdcluster.cluster.up_cmd import add_up_commands, build_config, launcher_options
from pdcluster.router.config import RouterConfig


def _parse(*argv: str) -> argparse.Namespace:
    sub = argparse.ArgumentParser().add_subparsers()
    add_up_commands(sub)
    return sub.choices["up"].parse_args(list(argv))


def _serve_defaults() -> argparse.Namespace:
    from pdcluster.cluster.serve_cmd import add_serve

    sub = argparse.ArgumentParser().add_subparsers()
    add_serve(sub)
    return sub.choices["serve"].parse_args([])


def test_defaults_match_serve() -> None:
    up, serve = _parse(), _serve_defaults()
    assert up.worker_threads == serve.worker_threads == "auto"
    assert up.disagg_mode == serve.disagg_mode == "sequential"


def test_flags_reach_the_router_spec_and_worker_env() -> None:
    args = _parse("--prefill", "1", "--decode", "2", "--connector", "p2p", "--disagg-mode", "concurrent",
                  "--worker-threads", "3")
    config = build_config(args)
    launcher = RayLauncher(config, address="local", **launcher_options(args))
    spec = launcher.router_spec()
    assert spec["disagg_mode"] == "concurrent"
    # The router actor builds RouterConfig from the spec (RouterActor.start): the field is real.
    fields = {k: v for k, v in spec.items() if k not in ("name", "namespace")}
    assert RouterConfig(workers=("127.0.0.1:1",), **fields).disagg_mode == "concurrent"
    plans = [InstancePlan("prefill", 0, "n1", ({"CPU": 1},)), InstancePlan("decode", 0, "n1", ({"CPU": 1},)),
             InstancePlan("decode", 1, "n2", ({"CPU": 1},))]
    nodes = {"n1": NodeInfo("n1", "10.0.0.1", {"CPU": 8}), "n2": NodeInfo("n2", "10.0.0.2", {"CPU": 4})}
    launcher.threads = worker_threads(config, plans, nodes, launcher.worker_threads, environ={})
    assert launcher.threads == {"prefill-0": 3, "decode-0": 3, "decode-1": 3}
    assert launcher._instance_env("decode-1", {"A": "1"}) == {"A": "1", ENV_THREADS: "3"}  # the actor's env


def test_auto_splits_each_nodes_cpus_between_its_ranks() -> None:
    config = ClusterConfig.from_dict({"pools": {"prefill": {"tp": 2}, "decode": {}}, "connector": "p2p"})
    plans = [InstancePlan("prefill", 0, "n1", ({"CPU": 2},)), InstancePlan("decode", 0, "n2", ({"CPU": 1},))]
    nodes = {"n1": NodeInfo("n1", "a", {"CPU": 9}), "n2": NodeInfo("n2", "b", {"CPU": 4})}
    assert worker_threads(config, plans, nodes, "auto", environ={}) == {"prefill-0": 4, "decode-0": 4}
    assert worker_threads(config, plans, nodes, "0", environ={}) == {}
    shared = [*plans, InstancePlan("decode", 1, "n1", ({"CPU": 1},))]  # 3 ranks on n1's 9 CPUs
    assert worker_threads(config, shared, nodes, "auto", environ={}) == {"prefill-0": 3, "decode-0": 4,
                                                                         "decode-1": 3}
    assert worker_threads(config, plans, nodes, "auto", environ={"OMP_NUM_THREADS": "2"}) == {}  # yours wins
    assert worker_threads(config, plans, nodes, "auto", environ={ENV_THREADS: "2"}) == {}


def test_bad_values_are_refused_by_the_parser() -> None:
    for argv in (("--worker-threads", "many"), ("--worker-threads", "-1"), ("--disagg-mode", "parallel")):
        with pytest.raises(SystemExit):
            _parse(*argv)
