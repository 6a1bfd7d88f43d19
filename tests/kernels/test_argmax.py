"""The greedy-token kernel (kernels/pointwise/argmax_triton.py) against torch.argmax on fresh random logits (TRITON_INTERPRET=1
on CPU): ties across and within parts, NaN, rows of -inf, bf16 and float32, and the arrival counts reset between
calls."""
from __future__ import annotations

import pytest
import torch

from kernels.pointwise.argmax_triton import BLOCK, ArgmaxWorkspace, argmax_rows


@pytest.mark.parametrize("rows,n,dtype", [(1, 5000, torch.float32), (3, BLOCK, torch.bfloat16),
                                          (4, 3 * BLOCK + 17, torch.float32), (2, 700, torch.bfloat16)])
def test_argmax_rows_equals_torch(rows, n, dtype):
    torch.manual_seed(rows * n)
    work = ArgmaxWorkspace(8, n, "cpu")
    for _ in range(3):  # fresh logits each time; a stale count would pick a part's result too early
        x = (torch.randn(rows, n) * 4).to(dtype)
        out = torch.full((rows,), -1, dtype=torch.int64)
        argmax_rows(x, out, work)
        assert out.tolist() == x.argmax(dim=-1).tolist()
        assert work.counts.tolist() == [0] * 8


def test_ties_nan_and_minus_inf_as_torch():
    n = 3 * BLOCK + 5
    x = torch.randn(6, n)
    x[0, [7, BLOCK + 3, 2 * BLOCK + 1]] = 50.0  # a tie across parts: the first
    x[1, [BLOCK + 9, BLOCK + 2]] = 50.0  # a tie inside one part
    x[2, :] = float("-inf")
    x[3, [BLOCK + 4, 2 * BLOCK + 8]] = float("nan")  # NaN is the largest: the first NaN
    x[3, 5] = float("inf")
    x[4, n - 1] = 99.0  # the last, partial part
    x[5, 2 * BLOCK] = float("inf")
    out = torch.empty(6, dtype=torch.int64)
    argmax_rows(x, out, ArgmaxWorkspace(6, n, "cpu"))
    assert out.tolist() == x.argmax(dim=-1).tolist() == [7, BLOCK + 2, 0, BLOCK + 4, n - 1, 2 * BLOCK]


def test_a_row_view_of_a_wider_buffer_and_bad_shapes():
    x = torch.randn(3, 900)[:, :800]  # rows of unit stride inside a wider buffer
    ids = torch.zeros(4, 5, dtype=torch.int64)
    argmax_rows(x, ids[3, :3], ArgmaxWorkspace(4, 800, "cpu"))
    assert ids[3, :3].tolist() == x.argmax(dim=-1).tolist()
    with pytest.raises(ValueError, match="holds 4 rows of 800"):
        argmax_rows(torch.randn(5, 800), torch.empty(5, dtype=torch.int64), ArgmaxWorkspace(4, 800, "cpu"))
    with pytest.raises(ValueError, match="unit stride"):
        argmax_rows(torch.randn(800, 2).t(), torch.empty(2, dtype=torch.int64), ArgmaxWorkspace(4, 800, "cpu"))
