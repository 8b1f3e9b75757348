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


def test_the_checkout_does_not_shadow_the_kernels_distribution() -> None:
    """kernels/ sits at the checkout's root and installs as `pdcluster.kernels`. With the root
    first on sys.path (`python -m pytest` from the checkout) `import kernels` would load it in place
    of Hugging Face's `kernels` distribution, which transformers >= 5.25 depends on and imports:
    every tiny checkpoint built by a test then fails. `make test` runs the pytest script instead."""
    import importlib
    import importlib.metadata

    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("Hugging Face's `kernels` is not installed here (transformers < 5.25)")
    module = importlib.import_module("kernels")
    origin = pathlib.Path(module.__file__).resolve()
    assert origin.parent != ROOT / "kernels", (
        f"`import kernels` loaded this checkout's {origin}: run the tests as `make test` (the pytest "
        f"script), not `python -m pytest` from the checkout's root")
