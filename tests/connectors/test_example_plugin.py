"""The out-of-tree example plugin (examples/connector_plugin): registered through the
`pdcluster.kv_connectors` entry point of an installed package, resolved by name, and passing the
conformance kit. Installs the example (editable, no deps, no network) when it is not installed."""

from __future__ import annotations

import importlib
import pathlib
import subprocess
import sys
from importlib import metadata
from typing import Any

import pytest

from pdcluster.connectors import ENTRY_POINT_GROUP, available_connectors, resolve_connector_class
from pdcluster.connectors.testing import ConnectorConformance

PLUGIN_DIR = pathlib.Path(__file__).resolve().parents[2] / "examples" / "connector_plugin"


def _registered() -> bool:
    return any(ep.name == "file" for ep in metadata.entry_points(group=ENTRY_POINT_GROUP))


@pytest.fixture(scope="module", autouse=True)
def installed_plugin() -> None:
    if not _registered():
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                               "-e", str(PLUGIN_DIR)], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"pip install of the example plugin failed:\n{proc.stdout}\n{proc.stderr}"
        importlib.invalidate_caches()
    # An editable install's import hook is only active in new interpreters: import it from source here.
    if str(PLUGIN_DIR) not in sys.path:
        sys.path.insert(0, str(PLUGIN_DIR))
    assert _registered(), "the example plugin's entry point is not visible after installing it"


def test_entry_point_resolves_to_the_plugin_class() -> None:
    cls = resolve_connector_class("file")
    assert cls.__name__ == "FileConnector" and cls.__module__.startswith("pdcluster_file_connector")
    assert available_connectors()["file"] == "pdcluster_file_connector:FileConnector"
    assert resolve_connector_class("pdcluster_file_connector:FileConnector") is cls  # dotted path too


def test_unknown_name_lists_what_is_available() -> None:
    with pytest.raises(ValueError, match=r"unknown KV connector 'nope'; available: file .*p2p"):
        resolve_connector_class("nope")
    with pytest.raises(ValueError, match="not a KVConnectorBase"):
        resolve_connector_class("pdcluster.connectors.registry:create_connector")


class TestFilePluginConformance(ConnectorConformance):
    connector_name = "file"  # through the entry point
    lease_options = {"lease_ttl_s": 1.5}

    def make_options(self, role: str, workdir: pathlib.Path) -> dict[str, Any]:
        return {"dir": str(workdir / "kv"), "load_timeout_s": 5.0}
