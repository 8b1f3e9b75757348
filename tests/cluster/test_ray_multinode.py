"""Two Ray nodes on one machine (ray.cluster_utils.Cluster), the launcher API in-process: the
prefill pool lands on the node with `prefill_node`, the decode pool on the one with `decode_node`;
requests go prefill -> P2P KV transfer -> decode across them; a killed worker actor is restarted by
Ray and re-admitted by the router; down() leaves no actor, placement group or process behind."""

from __future__ import annotations

import os
import time

import pytest

from pdcluster.cluster.config import ClusterConfig
from pdcluster.cluster.ray_head import pid_alive, process_tree, stop_processes

pytestmark = pytest.mark.ray


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    mp = pytest.MonkeyPatch()
    mp.setenv("PDCLUSTER_STATE_DIR", str(tmp_path_factory.mktemp("state")))
    # One auth mode for the nodes (they inherit os.environ) and this driver (Ray's cached config),
    # whatever earlier tests of the process left: this module is about placement and restarts;
    # token authentication is test_ray_auth's and the CLI tests'.
    mp.setenv("RAY_AUTH_MODE", "disabled")
    _refresh_ray_auth()
    before = {p for p, _ in process_tree(os.getpid())}
    # Each node carries one pool's resource; the head also runs the driver and the router.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"prefill_node": 1},
                                                            "include_dashboard": True})
    second = cluster.add_node(num_cpus=1, resources={"decode_node": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="mn", log_to_driver=False)
    try:
        yield cluster, second
    finally:
        tree = process_tree(os.getpid())  # the nodes' processes are our children: none may outlive us
        ray.shutdown()
        cluster.shutdown()
        mp.undo()
        _refresh_ray_auth()
        assert stop_processes([(p, t) for p, t in tree if p not in before])


def test_pools_on_their_nodes_restart_and_down(two_nodes) -> None:
    import ray
    from ray.util.placement_group import placement_group_table
    from ray.util.state import list_actors

    from pdcluster.client import Client
    from pdcluster.cluster.ray_launcher import RayLauncher
    from pdcluster.sampling_params import SamplingParams

    cluster, second = two_nodes
    config = ClusterConfig.from_dict({
        "namespace": "mn", "router": {"grpc_port": 0, "http_port": -1},
        "pools": {"prefill": {"max_restarts": 2, "placement": {"resource": "prefill_node"}},
                  "decode": {"placement": {"resource": "decode_node"}}},
        "connector": {"name": "p2p"}})
    launcher = RayLauncher(config, address=cluster.address)
    children: list[int] = []
    try:
        ep = launcher.up()
        nodes = {name: w["node_id"] for name, w in ep["instances"].items()}
        assert nodes == {"prefill-0": cluster.head_node.node_id, "decode-0": second.node_id}
        assert ep["node_id"] == cluster.head_node.node_id  # the router runs where `up` runs
        children = [w["child_pid"] for w in ep["instances"].values()]

        def generate():
            with Client(ep["grpc"], timeout=60) as c:
                return c.generate("Two nodes hand over the prompt's KV", SamplingParams(max_tokens=4, temperature=0.0))

        first = generate()
        assert first.route.disaggregated and first.route.prefill_worker_id == "prefill-0"
        # Kill the prefill actor (Ray's own failure path, not its process). Ray restarts it; the new
        # incarnation has a new port and epoch, registers with the router, which re-admits it, and
        # decode re-handshakes with it.
        victim = launcher.workers["prefill-0"]
        old = ep["instances"]["prefill-0"]["address"]
        ray.kill(victim, no_restart=False)
        fresh = wait_for(lambda: _ready(victim), 120, "the restarted actor")  # kill is asynchronous
        assert fresh["address"] != old and fresh["node_id"] == nodes["prefill-0"]
        children.append(fresh["child_pid"])
        with Client(ep["grpc"], timeout=10) as c:
            wait_for(lambda: {w.address for w in c.list_workers() if w.healthy}
                     == {ep["instances"]["decode-0"]["address"], fresh["address"]}, 60, "re-admission")
        again = generate()
        assert again.route.disaggregated and again.token_ids == first.token_ids
    finally:
        report = launcher.down()
    assert not report["left"], report
    assert not any(pid_alive(p) for p in children)
    assert ray.is_initialized()  # the launcher leaves a connection it did not open alone
    alive = list_actors(filters=[("ray_namespace", "=", "mn"), ("state", "!=", "DEAD")])
    assert alive == []
    groups = [t for t in placement_group_table().values() if t["name"].startswith("mn:") and t["state"] != "REMOVED"]
    assert groups == []


def test_a_worker_that_does_not_come_up_is_reported_and_nothing_is_left(two_nodes) -> None:
    from ray.util.placement_group import placement_group_table

    from pdcluster.cluster.ray_launcher import LaunchError, RayLauncher
    from pdcluster.cluster.ray_teardown import named_actors

    cluster, _ = two_nodes
    config = ClusterConfig.from_dict({
        "namespace": "bad", "router": {"grpc_port": 0, "http_port": -1}, "ready_timeout_s": 60,
        "pools": {"prefill": {"placement": {"resource": "prefill_node"}},
                  "decode": {"engine": {"dtype": "float7"}, "placement": {"resource": "decode_node"}}},
        "connector": "p2p"})
    launcher = RayLauncher(config, address=cluster.address)
    with pytest.raises(LaunchError) as e:
        launcher.up()
    msg = str(e.value)
    assert msg.startswith("1 of 2 workers did not come up") and "decode-0" in msg and "exited with" in msg
    assert "float7" in msg  # the tail of its log says why
    assert named_actors("bad") == []
    assert not [t for t in placement_group_table().values() if t["name"].startswith("bad:") and t["state"] != "REMOVED"]


def _refresh_ray_auth() -> None:
    """Ray caches RAY_AUTH_MODE and the token at import: re-read them, as Ray's own tests do."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def _ready(actor) -> dict | None:
    import ray

    try:
        info = ray.get(actor.ready.remote(30), timeout=40)
    except Exception:  # restarting
        return None
    return info if info["restarted"] else None
