"""Package surface: lazy imports, dispatch, exports."""

from __future__ import annotations

import subprocess
import sys

import pytest

import pdcluster.kernels as kernels
from pdcluster.kernels.ops import get_ops


def test_importing_the_package_and_modules_does_not_import_triton():
    code = (
        "import sys, pdcluster.kernels as k\n"
        "assert 'triton' not in sys.modules and 'torch' not in sys.modules\n"
        "k.get_ops('triton'); k.pack_kv_blocks_triton; k.moe_router_triton\n"
        "import pdcluster.models.layers.triton_attention\n"
        "assert 'triton' not in sys.modules, 'a kernel module imported triton at import time'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_torch_references_work_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None  # as if the optional extra were not installed\n"
        "import torch\n"
        "from pdcluster.kernels.norm import rms_norm_torch, rms_norm_triton\n"
        "x = torch.ones(2, 8)\n"
        "assert rms_norm_torch(x, torch.ones(8), 1e-6).shape == (2, 8)\n"
        "try:\n"
        "    rms_norm_triton(x, torch.ones(8), 1e-6)\n"
        "except ImportError as e:\n"
        "    assert 'pdcluster[triton]' in str(e)\n"
        "else:\n"
        "    raise AssertionError('expected ImportError')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_ops_dispatch():
    torch_ops, triton_ops = get_ops("torch"), get_ops("triton")
    assert triton_ops.rms_norm is kernels.rms_norm_triton
    assert triton_ops.reshape_and_cache is kernels.reshape_and_cache_triton
    # The torch set: the references, or their CPU C front ends (elementwise_cpu.py: each falls back
    # to its reference).
    for field in ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding", "reshape_and_cache"):
        assert getattr(torch_ops, field).__name__.endswith(("_torch", "_cpu"))
        assert getattr(triton_ops, field).__name__.endswith("_triton")
    with pytest.raises(ValueError, match="backend"):
        get_ops("cuda")


def test_every_export_resolves():
    for name in kernels.__all__:
        assert getattr(kernels, name) is not None
    with pytest.raises(AttributeError):
        kernels.not_a_kernel  # noqa: B018
