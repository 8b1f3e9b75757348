#!/usr/bin/env bash
# Create (or reuse) the project virtualenv and install pdcluster with the right torch build.
# Idempotent: a stamp keyed on the dependency files skips the work when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${PDCLUSTER_VENV:-.venv}"
PY="${PYTHON:-python3}"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
stamp="$VENV/.setup-$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
[ -f "$stamp" ] && exit 0

python -m pip install -q --upgrade pip
has_gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then has_gpu=1; fi
if ! python -c "import torch" >/dev/null 2>&1; then
  if [ "$has_gpu" = 1 ]; then
    # The default PyPI wheel on Linux is the CUDA build (it brings its own matching triton).
    python -m pip install -q "torch>=2.11,<2.14"
  else
    # A pinned CPU build; an unpinned torch pulls a multi-GB CUDA build on CPU-only machines.
    # Elsewhere, point PIP_EXTRA_INDEX_URL at PyTorch's CPU wheel index to get the same build.
    python -m pip install -q "torch==${PDCLUSTER_CPU_TORCH:-2.13.0}"
  fi
fi
# Triton runs the kernels (on CPU only through TRITON_INTERPRET=1, which the tests use).
python -c "import triton" >/dev/null 2>&1 || python -m pip install -q "triton>=3.6,<3.10"
python -m pip install -q -e ".[test,ray,bench]"
touch "$stamp"
