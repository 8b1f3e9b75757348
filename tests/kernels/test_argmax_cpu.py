"""Greedy sampling's C argmax (kernels/csrc/argmax_cpu.c) against torch.argmax(x, dim=-1): the
same index for every row, ties, NaNs, infinities and signed zeros included."""

from __future__ import annotations

import pytest
import torch

from pdcluster.kernels import argmax_cpu, argmax_rows

pytestmark = pytest.mark.skipif(not argmax_cpu._fn(), reason="no C compiler on this machine")


@pytest.mark.parametrize("rows", [0, 1, 3, 17])
@pytest.mark.parametrize("n", [1, 7, 64, 65, 129, 32000])
def test_random_rows_match_torch(rows: int, n: int) -> None:
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(rows * 1000 + n))
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


def test_ties_nans_infinities_and_signed_zeros_match_torch() -> None:
    n = 300
    x = torch.randn(9, n, generator=torch.Generator().manual_seed(7))
    x[0, [5, 70, 200]] = 50.0  # a tie: the first index
    x[1, 130] = float("nan")
    x[1, 250] = float("nan")
    x[1, 10] = float("inf")  # a NaN outranks +inf: the first NaN
    x[2] = float("-inf")  # every value -inf: index 0
    x[3] = -1.0
    x[3, 90] = -0.0
    x[3, 40] = 0.0  # -0.0 == 0.0: the first of the two
    x[4, n - 1] = 1e30  # the last index
    x[5, 0] = float("nan")  # a NaN first
    x[6, 64] = float("inf")  # the first value of a second block of 64
    x[7] = 3.0  # constant: index 0
    x[8, 63] = float("nan")  # the last value of the first block
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert argmax_rows(x).tolist()[:6] == [5, 130, 0, 40, n - 1, 0]


def test_rows_with_a_stride_and_the_cases_it_leaves_to_torch() -> None:
    wide = torch.randn(5, 1030, generator=torch.Generator().manual_seed(3))
    view = wide[:, :1000]  # an LM head padded past the vocabulary: rows 1030 apart
    assert torch.equal(argmax_rows(view), view.argmax(dim=-1))
    assert argmax_rows(wide.to(torch.bfloat16)) is None
    assert argmax_rows(wide.t()) is None  # the last dimension is not contiguous
    assert argmax_rows(wide[0]) is None  # not 2-D
    assert argmax_rows(torch.empty(2, 0)) is None  # no values to pick from
