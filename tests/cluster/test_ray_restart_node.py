"""A worker node of a `pdcluster up` cluster is lost (ray.cluster_utils.Cluster, removed without a
graceful drain): Ray reschedules the pool's placement group and restarts its actor once a node with
the pool's resource is added again; the restarted worker (new node, new port) registers with the
router, which drops the dead address and re-admits it after its health checks."""

from __future__ import annotations

import os
import time

import pytest

from pdcluster.cluster.config import ClusterConfig
from pdcluster.cluster.ray_head import process_tree, stop_processes

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # about 30-50 s: a whole node lost and re-added


def poll(fn, timeout_s: float, what: str):
    """fn() until truthy without raising; generous bounds, nothing assumes the machine's speed."""
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            value = fn()
            if value:
                return value
        except Exception as e:  # restarting: refused connections, actor errors
            last = e
        time.sleep(1.0)
    raise AssertionError(f"timed out waiting for {what} (last error: {last!r})")


@pytest.fixture
def lost_node_cluster(tmp_path):
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    mp = pytest.MonkeyPatch()
    mp.setenv("PDCLUSTER_STATE_DIR", str(tmp_path / "state"))
    mp.setenv("RAY_AUTH_MODE", "disabled")  # as test_ray_multinode: auth is test_ray_auth's
    _refresh_ray_auth()
    before = {p for p, _ in process_tree(os.getpid())}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    worker_node = cluster.add_node(num_cpus=1, resources={"worker_node": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="ln", log_to_driver=False)
    try:
        yield cluster, worker_node
    finally:
        tree = process_tree(os.getpid())
        ray.shutdown()
        cluster.shutdown()
        mp.undo()
        _refresh_ray_auth()
        assert stop_processes([(p, t) for p, t in tree if p not in before])


def test_worker_node_lost_and_readmitted(lost_node_cluster) -> None:
    from pdcluster.client import Client
    from pdcluster.cluster.ray_launcher import RayLauncher
    from pdcluster.sampling_params import SamplingParams

    cluster, node = lost_node_cluster
    config = ClusterConfig.from_dict({
        "namespace": "ln", "router": {"grpc_port": 0, "http_port": -1},
        "pools": {"both": {"max_restarts": 2, "placement": {"resource": "worker_node"}}}})
    launcher = RayLauncher(config, address=cluster.address)
    try:
        ep = launcher.up()
        (inst,) = ep["instances"].values()
        assert inst["node_id"] == node.node_id

        def generate():
            with Client(ep["grpc"], timeout=60) as c:
                return c.generate("A node goes away", SamplingParams(max_tokens=4, temperature=0.0))

        def healthy() -> set[str]:
            with Client(ep["grpc"], timeout=10) as c:
                return {w.address for w in c.list_workers() if w.healthy}

        first = generate()
        cluster.remove_node(node, allow_graceful=False)  # a crash: raylet and its workers killed
        poll(lambda: inst["address"] not in healthy(), 120, "the router to mark the lost worker down")
        replacement = cluster.add_node(num_cpus=1, resources={"worker_node": 1})
        back = poll(lambda: healthy() - {inst["address"]}, 300, "the rescheduled worker healthy at the router")
        assert len(healthy()) == 1 and inst["address"] not in healthy()  # the dead address is gone
        again = generate()
        assert again.token_ids == first.token_ids
        import ray

        info = ray.get(launcher.workers["both-0"].describe.remote(), timeout=30)
        assert info["node_id"] == replacement.node_id and info["restarted"] and info["address"] in back
    finally:
        report = launcher.down()
    assert not report["left"], report


def _refresh_ray_auth() -> None:
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
