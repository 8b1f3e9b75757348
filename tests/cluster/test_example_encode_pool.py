"""examples/cluster.yaml as shipped is valid (test_config.py), and so is its commented encode-pool
example: the lines marked `EXAMPLE:encode` uncommented (the live `ec_connector: null` dropped)."""

from __future__ import annotations

import pathlib
import re

from pdcluster.cluster.config import ClusterConfig, load_yaml

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "cluster.yaml"


def test_the_commented_encode_pool_example_is_valid(tmp_path) -> None:
    lines = EXAMPLE.read_text(encoding="utf-8").splitlines()
    marked = [i for i, line in enumerate(lines) if "# EXAMPLE:encode" in line]
    assert marked, "examples/cluster.yaml lost its encode-pool example"
    out = []
    for i, line in enumerate(lines):
        if line.strip() == "ec_connector: null":
            continue
        out.append(re.sub(r"^(\s*)# ", r"\1", line, count=1) if i in marked else line)
    path = tmp_path / "cluster.yaml"
    path.write_text("\n".join(out) + "\n", encoding="utf-8")
    c = ClusterConfig.from_dict(load_yaml(path))
    assert c.pools["encode"].instances == 1 and c.disaggregated
    assert c.ec_connector is not None and c.ec_connector.name == "p2p_ec"
    assert c.ec_connector.options == {"lease_s": 30.0, "max_bytes": 268435456}
    shipped = ClusterConfig.from_dict(load_yaml(EXAMPLE))
    assert "encode" not in shipped.pools and shipped.ec_connector is None
