"""FP8 KV scales in the connectors' fingerprints: fp8 bytes are value / scale, so two instances with
the same kv_cache_dtype but other checkpoint k/v scales must not exchange them. The P2P handshake
refuses such a pair naming the scales; the store's keys differ. Equal scales of either granularity
(per tensor 2.0, per head [2.0, 2.0]; explicit 1.0 or none) agree, and a non-fp8 cache's
fingerprints ignore scales (its keys are what they were)."""

from __future__ import annotations

import pathlib
import shutil
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from pdcluster.config import EngineArgs
from pdcluster.connectors.p2p.agent import ProducerAgent
from pdcluster.connectors.p2p.blocks import CacheGeometry
from pdcluster.connectors.p2p.options import P2POptions
from pdcluster.connectors.p2p.peer import ChannelPool, HandshakeCache, LoadError, Producer
from pdcluster.connectors.p2p.side_channel import SideChannelServer
from pdcluster.connectors.p2p.wire import fingerprint, fingerprint_mismatch
from pdcluster.connectors.store.options import build_layout
from pdcluster.models.hf_config import load_model_config
from pdcluster.security.keys import generate_keypair
from pdcluster.transfer import Region

PRODUCER, CONSUMER = generate_keypair("producer"), generate_keypair("consumer")


def _with_scales(demo: str, dest: pathlib.Path, k: Any, v: Any) -> str:
    """A copy of the demo checkpoint with every layer's k_scale / v_scale set (None: no scales)."""
    shutil.copytree(demo, dest)
    cfg = load_model_config(demo)
    if k is not None:
        tensors = {}
        for i in range(cfg.num_hidden_layers):
            tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k, dtype=torch.float32)
            tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v, dtype=torch.float32)
        save_file(tensors, str(dest / "kv_scales.safetensors"))
    return str(dest)


@pytest.fixture(scope="module")
def models(demo_model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("scales")
    heads = load_model_config(demo_model).num_key_value_heads
    return {
        "none": _with_scales(demo_model, root / "none", None, None),
        "ones": _with_scales(demo_model, root / "ones", 1.0, [1.0] * heads),
        "two": _with_scales(demo_model, root / "two", 2.0, 0.5),
        "two-per-head": _with_scales(demo_model, root / "two-ph", [2.0] * heads, [0.5] * heads),
        "three": _with_scales(demo_model, root / "three", 3.0, 0.5),
    }


def _config(model: str, kv: str) -> Any:
    return EngineArgs(model=model, kv_cache_dtype=kv, num_kv_blocks=64, max_model_len=256,
                      device="cpu").create_engine_config()


def test_p2p_fingerprint_carries_fp8_scales(models: dict[str, str]) -> None:
    fp = {name: fingerprint(_config(path, "fp8")) for name, path in models.items()}
    assert fp["none"] == fp["ones"]  # 1.0 is the default: the same decode
    assert fp["two"] == fp["two-per-head"]  # one value per tensor or the same value per head
    assert fp["two"]["kv_scales"] != fp["three"]["kv_scales"] != fp["none"]["kv_scales"]
    problem = fingerprint_mismatch(fp["two"], fp["three"]) or ""
    assert "kv_scales" in problem and "k_scale/v_scale" in problem
    # Without fp8 the scales are never read: not in the fingerprint.
    plain = {name: fingerprint(_config(path, "float32")) for name, path in models.items()}
    assert "kv_scales" not in plain["two"] and len({str(sorted(f.items())) for f in plain.values()}) == 1


def test_p2p_handshake_refuses_other_scales(models: dict[str, str]) -> None:
    ours, theirs = fingerprint(_config(models["two"], "fp8")), fingerprint(_config(models["three"], "fp8"))
    geo = CacheGeometry(num_layers=2, num_blocks=4, block_nbytes=256)
    cache = torch.zeros(geo.nbytes, dtype=torch.uint8)
    allowed = {"producer": PRODUCER.public, "consumer": CONSUMER.public}

    def opts(kp: Any, role: str, **kw: Any) -> P2POptions:
        return P2POptions(engine_id=f"sc-{role}", kv_role=role, keypair=kp, allowed_keys=allowed, **kw)

    popts = opts(PRODUCER, "producer", lease_ttl_s=30.0)
    agent = ProducerAgent(popts, theirs, geo, Region.from_buffer(cache), None)
    side = SideChannelServer(agent, popts)
    pool = ChannelPool(opts(CONSUMER, "consumer", request_timeout_s=2.0))
    try:
        producer = Producer("sc-producer", side.endpoint, PRODUCER.public)
        with pytest.raises(LoadError, match="kv_scales"):
            HandshakeCache(pool, opts(CONSUMER, "consumer"), ours).get(producer, 0)
        assert HandshakeCache(pool, opts(CONSUMER, "consumer"), theirs).get(producer, 0).body
    finally:
        pool.close()
        side.close()
        agent.close()


def test_store_keys_carry_fp8_scales(models: dict[str, str]) -> None:
    # model_id names the folder by default; pin it so only the scales can differ.
    fp8 = {name: build_layout({"model_id": "m"}, _config(path, "fp8")) for name, path in models.items()}
    assert fp8["none"].fingerprint == fp8["ones"].fingerprint
    assert fp8["two"].fingerprint == fp8["two-per-head"].fingerprint
    assert len({fp8[n].fingerprint for n in ("none", "two", "three")}) == 3
    h = bytes(range(32))
    assert fp8["two"].key(0, h) != fp8["three"].key(0, h)
    plain = {name: build_layout({"model_id": "m"}, _config(path, "bfloat16")) for name, path in models.items()}
    assert len({lay.fingerprint for lay in plain.values()}) == 1 and plain["two"].kv_scales == ""
