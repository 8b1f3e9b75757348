"""Cluster config and placement plan: every mistake fails before anything starts, naming the field.
Pure: no Ray, no processes; milliseconds."""

from __future__ import annotations

import argparse

import pytest

from pdcluster.cluster.config import ClusterConfig, ConfigError, load_yaml
from pdcluster.cluster.placement import NodeInfo, instance_bundles, plan_placement
from pdcluster.cluster.up_cmd import add_up_commands, apply_overrides, build_config
from pdcluster.cluster.worker_flags import engine_argv

CONNECTORS = ["p2p", "store"]


def parse(raw: dict) -> ClusterConfig:
    return ClusterConfig.from_dict(raw, connector_names=lambda: CONNECTORS)


def error(raw: dict) -> str:
    with pytest.raises(ConfigError) as e:
        parse(raw)
    return str(e.value)


DISAGG = {
    "model": "/models/m",
    "router": {"grpc_port": 0, "http_port": -1, "policy": "least_loaded"},
    "pools": {
        "prefill": {"instances": 2, "engine": {"max_model_len": 512, "no_prefix_caching": True},
                    "placement": {"strategy": "spread", "resource": "prefill_node"}},
        "decode": {"instances": 1, "tp": 2, "placement": {"strategy": "pack", "node_label": "pool=decode"}},
    },
    "connector": {"name": "p2p", "options": {"streams": 4}},
}


def test_defaults_are_one_aggregated_worker() -> None:
    c = parse({})
    assert list(c.pools) == ["both"] and c.pools["both"].instances == 1 and c.pools["both"].tp == 1
    assert not c.disaggregated and c.connector is None and c.router.grpc_port == 50051


def test_disaggregated_config_parses() -> None:
    c = parse(DISAGG)
    assert c.disaggregated and c.num_instances == 3
    assert c.pools["decode"].tp == 2 and c.pools["decode"].placement.label == ("pool", "decode")
    assert c.router.http_port is None and c.connector is not None and c.connector.options == {"streams": 4}
    assert engine_argv(c.pools["prefill"].engine) == ["--max-model-len", "512", "--no-prefix-caching"]


@pytest.mark.parametrize(("raw", "expected"), [
    ({"modle": "x"}, "config: unknown field(s) ['modle']; known fields: ["),
    ({"pools": {"both": {"instance": 2}}}, "pools.both: unknown field(s) ['instance']"),
    ({"pools": {"both": {"engine": {"max_len": 2}}}}, "pools.both.engine: unknown field(s) ['max_len']; known fields: ["),
    ({"pools": {"both": {"placement": {"strategy": "scatter"}}}}, "pools.both.placement.strategy: must be one of"),
    ({"router": {"polcy": "x"}}, "router: unknown field(s) ['polcy']"),
    ({"pools": {"mixed": {}}}, "pools: unknown field(s) ['mixed']"),
])
def test_unknown_fields_are_refused_with_the_known_ones(raw: dict, expected: str) -> None:
    assert expected in error(raw)


@pytest.mark.parametrize(("raw", "expected"), [
    ({"pools": {"decode": {"tp": 0}, "prefill": {}}, "connector": "p2p"},
     "pools.decode.tp: must be a positive integer, got 0"),
    ({"pools": {"both": {"tp": "2"}}}, "pools.both.tp: must be a positive integer, got '2'"),
    ({"pools": {"both": {"instances": True}}}, "pools.both.instances: must be a positive integer, got True"),
    ({"pools": {"both": {"engine": {"max_num_seqs": "many"}}}}, "pools.both.engine.max_num_seqs: must be an integer"),
    ({"pools": {"both": {"engine": {"no_prefix_caching": "yes"}}}}, "must be true or false"),
    ({"pools": {"both": {"engine": {"role": "decode"}}}}, "pools.both.engine: unknown field(s) ['role']"),
    ({"router": {"grpc_port": 70000}}, "router.grpc_port: must be an integer in [0, 65535], got 70000"),
    ({"router": {"policy": "random"}}, "router.policy: must be one of"),
    ({"pools": {"both": {"placement": {"node_label": "gpu"}}}}, "node_label: must look like 'key=value'"),
    ({"pools": {"prefill": {}}}, "pools: give either one `both` pool (aggregated) or `prefill` and `decode`"),
    ({"pools": {"both": {}, "decode": {}}}, "pools: give either one `both` pool"),
    ({"pools": {"prefill": {}, "decode": {}}}, "connector: prefill and decode pools need a KV connector"),
    ({"ready_timeout_s": 0}, "ready_timeout_s: must be a positive number"),
    ({"pools": []}, "pools: must be a mapping, got list"),
])
def test_bad_values_name_the_field(raw: dict, expected: str) -> None:
    assert expected in error(raw)


def test_unknown_connector_lists_the_available_ones() -> None:
    msg = error({**DISAGG, "connector": {"name": "nixl"}})
    assert msg.startswith("connector.name: unknown KV connector 'nixl'") and "['p2p', 'store']" in msg
    # A dotted path is the workers' to resolve (their nodes have the plugin).
    assert parse({**DISAGG, "connector": "my_pkg.conn:MyConnector"}).connector.name == "my_pkg.conn:MyConnector"


def test_known_connectors_come_from_the_registry() -> None:
    c = ClusterConfig.from_dict({**DISAGG, "connector": "p2p"})  # the real registry
    assert c.connector is not None and c.connector.name == "p2p"


# -- placement plan ------------------------------------------------------------------------------
def node(node_id: str, cpus: float, **extra: float) -> NodeInfo:
    labels = {k[6:]: str(v) for k, v in extra.items() if k.startswith("label_")}
    res = {k: v for k, v in extra.items() if not k.startswith("label_")}
    return NodeInfo(node_id, f"10.0.0.{len(node_id)}", {"CPU": cpus, **res}, None, labels)


def test_tp_larger_than_any_node_fails_naming_tp() -> None:
    c = parse({"pools": {"both": {"tp": 4}}})
    with pytest.raises(ConfigError, match=r"^pools\.both\.tp: an instance needs 4 CPU on one node .* largest "
                                          r"eligible node has 2 CPU"):
        plan_placement(c, [node("a", 2), node("b", 2)])  # 4 CPUs in all, but never on one node


def test_pool_without_a_matching_node_names_its_resource() -> None:
    c = parse(DISAGG)
    with pytest.raises(ConfigError, match=r"^pools\.prefill\.placement\.resource: no alive Ray node has 'prefill_node'"):
        plan_placement(c, [node("a", 8)])


def test_too_many_instances_names_instances() -> None:
    c = parse({"pools": {"both": {"instances": 3}}})
    with pytest.raises(ConfigError, match=r"^pools\.both\.instances: only 2 of 3 instances fit"):
        plan_placement(c, [node("a", 1), node("b", 1)])


def test_spread_and_pack_and_hard_constraints() -> None:
    c = parse({**DISAGG, "pools": {
        "prefill": {"instances": 3, "placement": {"strategy": "spread", "resource": "prefill_node"}},
        "decode": {"instances": 2, "tp": 2, "placement": {"strategy": "pack", "node_label": "pool=decode"}}}})
    nodes = [node("p1", 4, prefill_node=1), node("p2", 4, prefill_node=1), node("d1", 4, label_pool="decode"),
             node("d2", 4, label_pool="decode"), node("other", 64)]
    plans = plan_placement(c, nodes)
    assert [(p.name, p.node_id) for p in plans] == [
        ("prefill-0", "p1"), ("prefill-1", "p2"), ("prefill-2", "p1"),   # spread: round the eligible nodes
        ("decode-0", "d1"), ("decode-1", "d1"),                           # pack: fill d1 (4 CPU = 2 x tp 2)
    ]
    assert plans[3].label_selector == {"pool": "decode"} and plans[0].label_selector is None
    assert instance_bundles(c.pools["prefill"]) == ({"CPU": 1.0, "prefill_node": 0.01},)
    assert instance_bundles(c.pools["decode"]) == ({"CPU": 2.0},)


def test_dead_nodes_are_not_eligible() -> None:
    c = parse({})
    dead = NodeInfo("x", "10.0.0.9", {"CPU": 8}, None, {}, alive=False)
    assert plan_placement(c, [dead, node("a", 1)])[0].node_id == "a"


def test_node_info_from_ray_nodes_entry() -> None:
    n = NodeInfo.from_ray({"NodeID": "abc", "NodeManagerAddress": "10.1.1.1", "Alive": True,
                           "Resources": {"CPU": 2.0, "node:10.1.1.1": 1.0, "decode_node": 1.0},
                           "Labels": {"ray.io/node-id": "abc"}})
    assert n.resources["decode_node"] == 1.0 and n.labels["ray.io/node-id"] == "abc"
    assert "decode_node" in n.describe() and "node:" not in n.describe()


# -- file and flags ------------------------------------------------------------------------------
def up_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_up_commands(parser.add_subparsers(dest="command"))
    return parser.parse_args(["up", *argv])


def test_flags_override_the_file(tmp_path) -> None:
    import yaml

    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({**DISAGG, "connector": {"name": "my_pkg.conn:Mine", "options": {"a": 1}}}))
    c = build_config(up_args("--config", str(path), "--decode", "3", "--grpc-port", "6000", "--connector", "p2p"))
    assert c.pools["decode"].instances == 3 and c.pools["decode"].tp == 2  # the file's tp kept
    assert c.pools["prefill"].instances == 2 and c.router.grpc_port == 6000
    assert c.connector.name == "p2p" and c.connector.options == {"a": 1}
    c = build_config(up_args("--config", str(path), "--workers", "2"))
    assert list(c.pools) == ["both"] and c.pools["both"].instances == 2


def test_flag_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"^pools\.prefill\.instances: must be a positive integer, got 0"):
        build_config(up_args("--prefill", "0", "--decode", "1", "--connector", "p2p"))
    with pytest.raises(ValueError, match="--workers"):
        apply_overrides({}, {"workers": 1, "prefill": 1})


def test_example_cluster_yaml_is_valid() -> None:
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    c = ClusterConfig.from_dict(load_yaml(root / "examples" / "cluster.yaml"))
    assert c.disaggregated and c.connector is not None


def test_yaml_top_level_must_be_a_mapping(tmp_path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="the top level must be a mapping"):
        load_yaml(path)
