"""Kernel tests: every Triton launcher against its torch reference.

Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set here before any
kernel is compiled; pdcluster.kernels compiles lazily on first launch, so import order does not
matter). The interpreter is slow, so shapes are small but odd: block sizes 1/16/32, head dims
64/80/128, lengths that are not multiples of the block size, GQA ratios 1/4/8, empty batches.
On a CUDA machine the same tests run the compiled kernels on the GPU, plus the `gpu`-marked ones.

Tolerances (max |actual - expected| <= atol + rtol * |expected|), by the dtype of the output:
    float32:  1e-5 / 1e-5 element-wise, 2e-5 / 2e-5 attention (float32 accumulation both sides)
    float16:  2e-3 / 2e-3 element-wise, 4e-3 / 4e-3 attention
    bfloat16: 2e-2 / 2e-2 element-wise, 3e-2 / 2e-2 attention (about 2 ulp: the reference and the
              kernel round in different places, and the interpreter truncates float32 -> bfloat16)
float8 KV caches are compared at the query dtype's tolerance: both sides dequantise the same bytes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

HAS_CUDA = torch.cuda.is_available()
_HERE = Path(__file__).parent

TOLERANCES = {
    "elementwise": {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)},
    "attention": {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 2e-2)},
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and _HERE in Path(item.path).parents:
            item.add_marker(skip)


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def assert_close():
    """assert_close(actual, expected, dtype, kind="elementwise" | "attention")."""

    def check(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, kind: str = "elementwise") -> None:
        atol, rtol = TOLERANCES[kind][dtype]
        torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol)

    return check


KV_CASES = {
    # id: (query / model dtype, cache dtype, scale kind)
    "f32": (torch.float32, torch.float32, None),
    "bf16": (torch.bfloat16, torch.bfloat16, None),
    "f16": (torch.float16, torch.float16, None),
    "bf16-fp8-tensor": (torch.bfloat16, torch.float8_e4m3fn, "tensor"),
    "f16-fp8-head": (torch.float16, torch.float8_e4m3fn, "head"),
}


@dataclass
class PagedKV:
    dtype: torch.dtype  # query / model dtype of the case
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None


@pytest.fixture(params=list(KV_CASES))
def kv_case(request: pytest.FixtureRequest) -> str:
    """Every KV dtype case, by id."""
    return request.param


@pytest.fixture
def make_paged_kv(device: torch.device):
    """make_paged_kv(seq_lens, num_kv_heads, head_dim, block_size, case) -> PagedKV, case a KV_CASES id.

    Blocks are scattered at random over a cache larger than needed; every slot that no request
    owns holds NaN, so a kernel reading past a request's keys (or a padding block-table entry)
    poisons its output instead of passing by luck. Block tables carry one extra padding column.
    """
    from pdcluster.kernels.cache_write import reshape_and_cache_torch

    def build(seq_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int, case: str) -> PagedKV:
        model_dtype, cache_dtype, scale_kind = KV_CASES[case]
        blocks_per_req = [-(-n // block_size) for n in seq_lens]
        width = max(blocks_per_req, default=0) + 1
        num_blocks = sum(blocks_per_req) + 3
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        k_cache = torch.full(shape, float("nan"), device=device).to(cache_dtype)
        v_cache = torch.full(shape, float("nan"), device=device).to(cache_dtype)
        perm = torch.randperm(num_blocks, device=device)
        block_tables = torch.zeros((len(seq_lens), width), dtype=torch.int32, device=device)
        k_scale = v_scale = None
        if scale_kind == "tensor":
            k_scale, v_scale = torch.tensor(0.02, device=device), torch.tensor(0.03, device=device)
        elif scale_kind == "head":
            k_scale = torch.rand(num_kv_heads, device=device) * 0.03 + 0.01
            v_scale = torch.rand(num_kv_heads, device=device) * 0.03 + 0.01
        used = 0
        for b, n in enumerate(seq_lens):
            ids = perm[used : used + blocks_per_req[b]]
            used += blocks_per_req[b]
            block_tables[b, : len(ids)] = ids.int()
            pos = torch.arange(n, device=device)
            slots = ids[pos // block_size].long() * block_size + pos % block_size
            k = torch.randn(n, num_kv_heads, head_dim, device=device, dtype=model_dtype)
            v = torch.randn(n, num_kv_heads, head_dim, device=device, dtype=model_dtype)
            reshape_and_cache_torch(k, v, k_cache, v_cache, slots, k_scale, v_scale)
        return PagedKV(model_dtype, k_cache, v_cache, block_tables, k_scale, v_scale)

    return build
