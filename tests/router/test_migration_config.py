"""The migration bound and the conditional-disaggregation threshold as settings: RouterConfig,
`pdcluster serve`/`router` flags, `pdcluster up` flags and the cluster YAML's router section (the
Ray router actor builds its RouterConfig from that section's fields). Pure: no processes."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from pdcluster.cluster.config import ClusterConfig, ConfigError
from pdcluster.cluster.router_cmd import router_config as _router_config
from pdcluster.cluster.serve_cmd import _pools, add_serve
from pdcluster.cluster.up_cmd import add_up_commands, build_config
from pdcluster.router.config import RouterConfig

PD_POOLS = {"pools": {"prefill": {"instances": 1}, "decode": {"instances": 1}}, "connector": {"name": "p2p"}}


def _parse(add, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add(parser.add_subparsers(dest="command"))
    return parser.parse_args(list(argv))


def test_router_config_defaults_and_bounds() -> None:
    assert RouterConfig().max_migrations == 2 and RouterConfig().disagg_min_uncached_tokens == 0
    assert RouterConfig(max_migrations=0).max_migrations == 0
    with pytest.raises(ValueError, match="max_migrations must be >= 0, got -1"):
        RouterConfig(max_migrations=-1)
    assert RouterConfig().stall_timeout_s == 0.0  # off: wait for the deadline
    with pytest.raises(ValueError, match="stall_timeout_s must be >= 0"):
        RouterConfig(stall_timeout_s=-1.0)


def test_serve_flags_reach_the_router_config() -> None:
    args = _parse(add_serve, "serve", "--max-migrations", "5", "--disagg-threshold", "64", "--stall-timeout", "7.5")
    config = _router_config(args, (), None, None)
    assert (config.max_migrations, config.disagg_min_uncached_tokens, config.stall_timeout_s) == (5, 64, 7.5)
    config = _router_config(_parse(add_serve, "serve"), (), None, None)
    assert (config.max_migrations, config.disagg_min_uncached_tokens) == (2, 0)
    assert config.disagg_max_prefill_backlog_tokens == 0
    config = _router_config(_parse(add_serve, "serve", "--disagg-max-prefill-backlog", "768"), (), None, None)
    assert config.disagg_max_prefill_backlog_tokens == 768
    assert config.disagg_max_decode_inflight is None
    config = _router_config(_parse(add_serve, "serve", "--disagg-max-prefill-backlog", "256",
                                   "--disagg-max-decode-inflight", "0"), (), None, None)
    assert (config.disagg_max_prefill_backlog_tokens, config.disagg_max_decode_inflight) == (256, 0)


def test_cluster_yaml_router_section(tmp_path) -> None:
    c = ClusterConfig.from_dict({"router": {"max_migrations": 0, "disagg_min_uncached_tokens": 128,
                                            "stall_timeout_s": 20}, **PD_POOLS})
    assert (c.router.max_migrations, c.router.disagg_min_uncached_tokens, c.router.stall_timeout_s) == (0, 128, 20.0)
    with pytest.raises(ConfigError, match=r"^router\.stall_timeout_s: must be a non-negative number"):
        ClusterConfig.from_dict({"router": {"stall_timeout_s": -2}})
    # The Ray router actor passes the section's fields to RouterConfig by name.
    fields = dataclasses.asdict(c.router)
    config = RouterConfig(**{k: v for k, v in fields.items() if k in {f.name for f in dataclasses.fields(RouterConfig)}})
    assert (config.max_migrations, config.disagg_min_uncached_tokens) == (0, 128)
    assert set(fields) <= {f.name for f in dataclasses.fields(RouterConfig)}
    c = ClusterConfig.from_dict({"router": {"disagg_max_prefill_backlog_tokens": 512}, **PD_POOLS})
    assert RouterConfig(disagg_max_prefill_backlog_tokens=512) and c.router.disagg_max_prefill_backlog_tokens == 512
    for key in ("max_migrations", "disagg_min_uncached_tokens", "disagg_max_prefill_backlog_tokens"):
        with pytest.raises(ConfigError, match=rf"^router\.{key}: must be"):
            ClusterConfig.from_dict({"router": {key: -1}})
    c = ClusterConfig.from_dict({"router": {"disagg_max_prefill_backlog_tokens": 256,
                                            "disagg_max_decode_inflight": 1}, **PD_POOLS})
    assert c.router.disagg_max_decode_inflight == 1 and RouterConfig(**{
        k: v for k, v in dataclasses.asdict(c.router).items()
        if k in {f.name for f in dataclasses.fields(RouterConfig)}}).disagg_max_decode_inflight == 1
    with pytest.raises(ConfigError, match=r"^router\.disagg_max_decode_inflight: must be"):
        ClusterConfig.from_dict({"router": {"disagg_max_prefill_backlog_tokens": 256,
                                            "disagg_max_decode_inflight": -1}, **PD_POOLS})
    with pytest.raises(ConfigError, match=r"^router\.disagg_max_decode_inflight: .*needs "
                                          r"router\.disagg_max_prefill_backlog_tokens > 0"):
        ClusterConfig.from_dict({"router": {"disagg_max_decode_inflight": 1}, **PD_POOLS})


def test_up_flags_override_the_file(tmp_path) -> None:
    import yaml

    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({"router": {"max_migrations": 1, "disagg_min_uncached_tokens": 16}, **PD_POOLS}))
    c = build_config(_parse(add_up_commands, "up", "--config", str(path)))
    assert (c.router.max_migrations, c.router.disagg_min_uncached_tokens) == (1, 16)
    c = build_config(_parse(add_up_commands, "up", "--config", str(path), "--disagg-threshold", "48",
                            "--max-migrations", "3"))
    assert (c.router.max_migrations, c.router.disagg_min_uncached_tokens) == (3, 48)
    assert c.router.disagg_max_prefill_backlog_tokens == 0
    c = build_config(_parse(add_up_commands, "up", "--config", str(path), "--disagg-max-prefill-backlog", "300"))
    assert (c.router.disagg_min_uncached_tokens, c.router.disagg_max_prefill_backlog_tokens) == (16, 300)
    c = build_config(_parse(add_up_commands, "up", "--config", str(path), "--disagg-max-prefill-backlog", "300",
                            "--disagg-max-decode-inflight", "0"))
    assert (c.router.disagg_max_prefill_backlog_tokens, c.router.disagg_max_decode_inflight) == (300, 0)


def test_disaggregation_rules_need_prefill_and_decode_pools() -> None:
    """A rule for when to disaggregate does nothing without both pools: refused by name, not ignored."""
    for flag in ("--disagg-threshold", "--disagg-max-prefill-backlog"):
        with pytest.raises(ValueError, match=f"^{flag} needs --prefill and --decode pools"):
            _pools(_parse(add_serve, "serve", "--workers", "2", flag, "64"))
        with pytest.raises(ValueError, match=f"^{flag} needs --prefill and --decode pools"):
            _pools(_parse(add_serve, "serve", flag, "64"))  # the default: one aggregated worker
        assert _pools(_parse(add_serve, "serve", "--prefill", "1", "--decode", "1", flag, "64")) == [
            ("prefill", 1), ("decode", 1)]
    assert _pools(_parse(add_serve, "serve", "--workers", "2", "--disagg-threshold", "0")) == [("both", 2)]
    with pytest.raises(ValueError, match="^--disagg-max-decode-inflight needs --prefill and --decode pools"):
        _pools(_parse(add_serve, "serve", "--workers", "2", "--disagg-max-decode-inflight", "0"))
    with pytest.raises(ConfigError, match=r"^router\.disagg_max_prefill_backlog_tokens: needs prefill and decode pools"):
        ClusterConfig.from_dict({"router": {"disagg_max_prefill_backlog_tokens": 64, "disagg_max_decode_inflight": 0},
                                 "pools": {"both": {"instances": 2}}})
    for key in ("disagg_min_uncached_tokens", "disagg_max_prefill_backlog_tokens"):
        with pytest.raises(ConfigError, match=rf"^router\.{key}: needs prefill and decode pools"):
            ClusterConfig.from_dict({"router": {key: 64}})
        with pytest.raises(ConfigError, match=rf"^router\.{key}: needs prefill and decode pools"):
            ClusterConfig.from_dict({"router": {key: 64}, "pools": {"both": {"instances": 2}}})
        assert ClusterConfig.from_dict({"router": {key: 0}, "pools": {"both": {"instances": 2}}})
