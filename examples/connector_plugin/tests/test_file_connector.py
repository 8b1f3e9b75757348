"""Run pdcluster's connector conformance kit on the example plugin (installed or not)."""

from __future__ import annotations

import pathlib
import sys
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from pdcluster.connectors.testing import ConnectorConformance  # noqa: E402


class TestFileConnector(ConnectorConformance):
    connector_name = "pdcluster_file_connector:FileConnector"
    lease_options = {"lease_ttl_s": 1.5}

    def make_options(self, role: str, workdir: pathlib.Path) -> dict[str, Any]:
        return {"dir": str(workdir), "load_timeout_s": 5.0}
