"""The models registry says what it supports and what each architecture needs, without torch."""

from __future__ import annotations

import subprocess
import sys

from pdcluster.models.registry import ARCHITECTURE_NOTES, describe_architectures, supported_architectures


def test_every_architecture_has_its_note() -> None:
    assert set(ARCHITECTURE_NOTES) == set(supported_architectures())
    assert all(note for _, note in describe_architectures())


def test_describe_does_not_import_torch() -> None:
    code = ("import sys; from pdcluster.models.registry import describe_architectures; "
            "describe_architectures(); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
