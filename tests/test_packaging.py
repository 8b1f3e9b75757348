"""The built wheel must contain every module of every component folder (pyproject lists packages
explicitly, so a new package folder that is not listed would silently vanish from installs)."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
COMPONENTS = {
    "pdcluster": "pdcluster", "kernels": "pdcluster/kernels", "cluster": "pdcluster/cluster",
    "prefill_worker": "pdcluster/prefill_worker", "decode_worker": "pdcluster/decode_worker",
    "connectors": "pdcluster/connectors", "router": "pdcluster/router", "kvstore": "pdcluster/kvstore",
}


def _expected_modules() -> set[str]:
    out = set()
    for folder, dest in COMPONENTS.items():
        for f in (ROOT / folder).rglob("*.py"):
            if "__pycache__" in f.parts:
                continue
            out.add(f"{dest}/{f.relative_to(ROOT / folder).as_posix()}")
    return out


@pytest.mark.timeout(300)
def test_wheel_contains_every_module(tmp_path: pathlib.Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(ROOT)], check=True)
    wheel = next(tmp_path.glob("pdcluster-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(_expected_modules() - names)
    assert not missing, f"modules missing from the wheel (add their package to pyproject.toml): {missing}"
    assert "pdcluster/_proto/__init__.py" in names
    csrc = {f"pdcluster/kernels/csrc/{f.name}" for f in (ROOT / "kernels" / "csrc").glob("*.c")}
    assert csrc and csrc <= names, f"C kernel sources missing from the wheel: {sorted(csrc - names)}"


def test_component_folders_do_not_shadow_installed_packages() -> None:
    """The component folders sit at the checkout's root under their own names (`kernels/` installs as
    `pdcluster.kernels`). A test process with the root on sys.path would import this checkout's
    `kernels/` where a library asks for the `kernels` distribution (transformers >= 5.25 depends on
    Hugging Face's `kernels` and imports it); the test command must keep the root off sys.path."""
    import importlib.util

    for name in COMPONENTS:
        if name == "pdcluster":
            continue
        spec = importlib.util.find_spec(name)
        origin = pathlib.Path(spec.origin).resolve() if spec is not None and spec.origin else None
        assert origin is None or ROOT not in origin.parents or "site-packages" in origin.parts, (
            f"`import {name}` resolves to this checkout's {origin}: run the tests as `make test` "
            f"(the pytest script), not `python -m pytest` from the checkout's root")
