"""Encode pools in `serve` and the cluster YAML (milliseconds): --encode N beside the prefill/decode
or aggregated pools, the EC connector each instance runs (auto: p2p_ec for a multimodal model when
instances can share), per-pool engine flags (--encode-FLAG), the YAML's `encode` pool and `ec_connector`."""

from __future__ import annotations

import argparse
import json

import pytest

from pdcluster.cluster.config import ClusterConfig, ConfigError
from pdcluster.cluster.serve_cmd import _pools, add_serve, ec_connector_choice
from pdcluster.cluster.worker_flags import engine_argv, forwarded_engine


def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


@pytest.fixture
def llava_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlavaForConditionalGeneration"],
                                                      "vision_config": {"hidden_size": 8}, "text_config": {}}))
    return str(tmp_path)


def test_encode_pool_goes_first_beside_prefill_decode_or_aggregated() -> None:
    assert _pools(serve_args("--encode", "1", "--prefill", "2", "--decode", "1")) == [
        ("encode", 1), ("prefill", 2), ("decode", 1)]
    assert _pools(serve_args("--encode", "2", "--workers", "1")) == [("encode", 2), ("both", 1)]
    assert _pools(serve_args("--encode", "1")) == [("encode", 1), ("both", 1)]
    assert _pools(serve_args("--prefill", "1", "--decode", "1")) == [("prefill", 1), ("decode", 1)]  # unchanged
    with pytest.raises(ValueError, match="--encode must be at least 0"):
        _pools(serve_args("--encode", "-1"))


def test_ec_connector_auto_none_and_named(llava_dir, tmp_path_factory) -> None:
    text_dir = tmp_path_factory.mktemp("text")
    (text_dir / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    text_model = str(text_dir)
    epd = [("encode", 1), ("prefill", 1), ("decode", 1)]
    assert ec_connector_choice("auto", llava_dir, epd) == "p2p_ec"
    assert ec_connector_choice("auto", llava_dir, [("prefill", 2), ("decode", 1)]) == "p2p_ec"  # P shares with P
    assert ec_connector_choice("auto", llava_dir, [("prefill", 1), ("decode", 1)]) == ""  # nobody to share with
    assert ec_connector_choice("auto", llava_dir, [("both", 1)]) == ""
    assert ec_connector_choice("auto", text_model, [("prefill", 2), ("decode", 1)]) == ""
    assert ec_connector_choice("my.pkg:EC", llava_dir, [("both", 1)]) == "my.pkg:EC"
    assert ec_connector_choice("none", llava_dir, [("prefill", 2), ("decode", 1)]) == ""
    with pytest.raises(ValueError, match="--encode needs an EC connector"):
        ec_connector_choice("none", llava_dir, epd)


def test_encode_pool_engine_flags() -> None:
    args = serve_args("--encode", "1", "--max-model-len", "256", "--encode-max-num-seqs", "4")
    assert engine_argv(forwarded_engine(args, "encode")) == ["--max-model-len", "256", "--max-num-seqs", "4"]
    assert engine_argv(forwarded_engine(args, "prefill")) == ["--max-model-len", "256"]


def test_yaml_encode_pool_and_ec_connector() -> None:
    raw = {"pools": {"encode": {"instances": 2}, "prefill": {}, "decode": {}}, "connector": "p2p"}
    c = ClusterConfig.from_dict(raw, connector_names=lambda: ["p2p"])
    assert c.pools["encode"].instances == 2 and c.disaggregated
    assert c.ec_connector is not None and c.ec_connector.name == "p2p_ec"  # the default with encoders
    agg = ClusterConfig.from_dict({"pools": {"encode": {}, "both": {}}}, connector_names=lambda: ["p2p"])
    assert not agg.disaggregated and agg.ec_connector.name == "p2p_ec"
    plain = ClusterConfig.from_dict({"pools": {"both": {}}}, connector_names=lambda: ["p2p"])
    assert plain.ec_connector is None
    named = ClusterConfig.from_dict({"pools": {"both": {"instances": 2}}, "ec_connector": {"name": "p2p_ec",
                                     "options": {"lease_s": 5}}}, connector_names=lambda: ["p2p"])
    assert named.ec_connector.options == {"lease_s": 5}
    with pytest.raises(ConfigError, match="encode pool needs an EC connector"):
        ClusterConfig.from_dict({"pools": {"encode": {}, "both": {}}, "ec_connector": "none"})
    with pytest.raises(ConfigError, match="ec_connector.name: unknown EC connector 'nope'"):
        ClusterConfig.from_dict({"pools": {"both": {}}, "ec_connector": "nope"})
    with pytest.raises(ConfigError, match="optionally an `encode` pool"):
        ClusterConfig.from_dict({"pools": {"encode": {}}})


def test_up_overrides_keep_or_size_the_encode_pool() -> None:
    from pdcluster.cluster.up_cmd import apply_overrides

    raw = {"pools": {"encode": {"instances": 2}, "prefill": {}, "decode": {}}, "connector": "p2p"}
    assert set(apply_overrides(raw, {"workers": 1})["pools"]) == {"both", "encode"}
    assert apply_overrides(raw, {"encode": 3})["pools"]["encode"]["instances"] == 3
    assert "encode" not in apply_overrides(raw, {"encode": 0})["pools"]
    assert apply_overrides({}, {"encode": 1, "prefill": 1, "decode": 1})["pools"] == {
        "prefill": {"instances": 1}, "decode": {"instances": 1}, "encode": {"instances": 1}}
    assert apply_overrides({}, {"ec_connector": "none"})["ec_connector"] == "none"
    assert apply_overrides({}, {"ec_connector": "p2p_ec"})["ec_connector"] == {"name": "p2p_ec"}


def test_ray_encode_instances_get_the_ec_connector_and_no_kv_connector() -> None:
    import json

    from pdcluster.cluster.ray_launcher import _worker_argv
    from pdcluster.cluster.ray_secrets import ENV_CONNECTOR_OPTIONS, ENV_EC_OPTIONS, cluster_secrets

    raw = {"pools": {"encode": {}, "prefill": {}, "decode": {}}, "connector": "p2p"}
    c = ClusterConfig.from_dict(raw, connector_names=lambda: ["p2p"])
    encode, prefill = _worker_argv(c, "encode"), _worker_argv(c, "prefill")
    assert "--kv-connector" not in encode and encode[encode.index("--ec-connector") + 1] == "p2p_ec"
    assert prefill[prefill.index("--kv-connector") + 1] == "p2p" and "--ec-connector" in prefill
    secrets = cluster_secrets(c)
    try:
        env = secrets.for_instance("encode-0")
        assert env[ENV_CONNECTOR_OPTIONS] == ""  # no KV connector there, so none of its secrets
        ec = json.loads(env[ENV_EC_OPTIONS])
        assert set(ec["allowed_keys"]) == {"encode-0", "prefill-0", "decode-0"}
        assert ec["keypair"].split(",")[0] == ec["allowed_keys"]["encode-0"]  # its own pair
        assert json.loads(secrets.for_instance("prefill-0")[ENV_EC_OPTIONS])["keypair"] != ec["keypair"]
        assert json.loads(secrets.for_instance("prefill-0")[ENV_CONNECTOR_OPTIONS])["params_secret"]
    finally:
        import shutil

        if secrets.key_dir:
            shutil.rmtree(secrets.key_dir, ignore_errors=True)
