"""Quantized weights: the quantization's error bound, and every path of the quantized linear (torch's int8
matmul, the dequantized weights, the Triton GEMV with each prologue) against the float64 product of the
dequantized weights, on fresh random inputs (TRITON_INTERPRET=1 on CPU)."""
from __future__ import annotations

import pytest
import torch

from kernels.pointwise.activation import silu_and_mul_ref
from kernels.linear.linear import act_linear_ref, linear_ref, norm_linear_ref
from kernels.pointwise.norm import fused_add_rms_norm_ref
from kernels.linear.quant import QuantizedWeight, qlinear, qlinear_exact, quantize


def _close(out: torch.Tensor, exact: torch.Tensor, rel: float) -> None:
    """out within ``rel`` of the exact product's scale (float32 sums, or bfloat16 activations)."""
    err = (out.to(torch.float64) - exact).abs().max().item()
    assert err <= rel * exact.abs().max().item() + 1e-6, f"max error {err:.3g} against |max| {exact.abs().max():.3g}"


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("n,k", [(7, 33), (64, 576), (300, 96)])
def test_quantization_error_is_bounded_per_channel(kind, n, k):
    w = torch.randn(n, k) * torch.rand(n, 1) * 3  # rows of different ranges: one scale each
    w[0] = 0.0  # an all-zero row keeps a usable scale
    qw = quantize(w, kind)
    assert qw.q.dtype == (torch.int8 if kind == "int8" else torch.float8_e4m3fn) and qw.q.shape == (n, k)
    assert qw.scale.shape == (n,) and qw.scale.dtype == torch.float32 and torch.isfinite(qw.scale).all()
    err = (qw.dequantize() - w).abs()
    if kind == "int8":  # rounding to the nearest step: at most half a step per weight
        assert (err <= qw.scale[:, None] / 2 + 1e-7).all()
    else:  # e4m3 keeps 3 mantissa bits: within 1/16 of the value, or half the smallest subnormal step
        assert (err <= w.abs() / 16 + qw.scale[:, None] * 2.0 ** -10 + 1e-7).all()
    assert torch.equal(qw.dequantize()[0], torch.zeros(k))
    # the row's largest |w| is representable exactly: no value clips
    assert torch.allclose(qw.dequantize().abs().amax(1), w.abs().amax(1), rtol=1e-6)


def test_quantize_refuses_what_it_cannot_represent():
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize(torch.tensor([[1.0, float("nan")]]), "int8")
    with pytest.raises(ValueError, match="unknown weight dtype"):
        quantize(torch.randn(4, 4), "int4")
    with pytest.raises(ValueError, match="2-D float"):
        quantize(torch.randn(4), "int8")
    with pytest.raises(ValueError, match="columns"):
        qlinear(torch.randn(2, 5), quantize(torch.randn(3, 4), "int8"))


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("m", [1, 3, 8, 40])  # the int8 matmul for <= 8 rows on CPU, the dequantized weights above
@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("k", [200, 208])  # the int8 weight-pack matmul takes K of 16-multiples only
def test_plain_torch_quantized_linear(kind, m, keep, k):
    n = 96
    qw = quantize(torch.randn(n, k), kind, keep_dequantized=keep)
    x, b = torch.randn(m, k), torch.randn(n)
    exact = qlinear_exact(x, qw, b)
    # the int8 matmul takes bfloat16 activations (8 bits of mantissa): 1% of the output's scale
    rel = 1e-2 if kind == "int8" and m <= 8 else 1e-5
    _close(qlinear(x, qw, b), exact, rel)
    _close(linear_ref(x, qw, b), exact, rel)  # the reference linear takes quantized weights too
    assert qlinear(x, qw).dtype == x.dtype


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("m,n,k,tiles", [
    (1, 40, 72, (4, 64, 4)),  # partial last tile in N and K
    (3, 100, 130, (8, 32, 4)),
    (4, 33, 256, (16, 128, 2)),
    (1, 24, 96, (4, 128, 4)),  # one row, the whole row in one chunk (reduced at once)
])
def test_triton_gemv_with_quantized_weights(kind, m, n, k, tiles):
    from kernels.linear.linear_triton import act_linear_triton, linear_triton, norm_linear_triton

    t = dict(zip(("block_n", "block_k", "num_warps"), tiles))
    qw = quantize(torch.randn(n, k), kind)
    x, r, nw, b = torch.randn(m, k), torch.randn(m, k), torch.randn(k), torch.randn(n)
    _close(linear_triton(x, qw, b, **t), qlinear_exact(x, qw, b), 1e-5)
    out, summed = norm_linear_triton(x, r, nw, 1e-6, qw, b, **t)
    h, ref_summed = fused_add_rms_norm_ref(x, r, nw, 1e-6)
    _close(out, qlinear_exact(h, qw, b), 1e-5)
    torch.testing.assert_close(summed, ref_summed)
    gu = torch.randn(m, 2 * k)
    _close(act_linear_triton(gu, qw, **t), qlinear_exact(silu_and_mul_ref(gu), qw), 1e-5)
    # more rows than max_m: the plain-torch quantized product after the Triton norm / activation (int8
    # weights take the kernel up to 16 rows: 9 rows there, 20 through torch)
    for rows in (9, 20):
        x9, r9, gu9 = torch.randn(rows, k), torch.randn(rows, k), torch.randn(rows, 2 * k)
        _close(linear_triton(x9, qw, b, max_m=4), qlinear_exact(x9, qw, b), 1e-5)
        _close(norm_linear_triton(x9, r9, nw, 1e-6, qw, b, max_m=4)[0],
               qlinear_exact(fused_add_rms_norm_ref(x9, r9, nw, 1e-6)[0], qw, b), 1e-5)
        _close(act_linear_triton(gu9, qw, max_m=4), qlinear_exact(silu_and_mul_ref(gu9), qw), 1e-5)
    # the composed references agree too
    _close(norm_linear_ref(x9, r9, nw, 1e-6, qw, b)[0], qlinear_exact(fused_add_rms_norm_ref(x9, r9, nw, 1e-6)[0],
                                                                       qw, b), 1e-5)
    _close(act_linear_ref(gu9, qw), qlinear_exact(silu_and_mul_ref(gu9), qw), 1e-5)


def test_gemv_reads_every_fp8_code():
    """The GEMV reads every finite e4m3 code as its value, subnormals, both zeros and both signs among them: each
    row of a one-hot input picks one code; the weight rows hold all 254 finite codes."""
    from kernels.linear.linear_triton import linear_triton

    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # 0x7F / 0xFF: NaN
    q = codes.view(torch.float8_e4m3fn).reshape(1, -1).repeat(3, 1)
    k = q.shape[1]
    scale = torch.tensor([1.0, 0.5, 2.0 ** -9])
    qw = QuantizedWeight("fp8", q.contiguous(), scale, torch.float32)
    values = codes.view(torch.float8_e4m3fn).to(torch.float64)
    for cols in (torch.arange(4), torch.arange(k - 4, k), torch.tensor([0, 1, 7, 8])):  # large, subnormal codes
        x = torch.zeros(4, k)
        x[torch.arange(4), cols] = 1.0
        out = linear_triton(x, qw, block_n=4, block_k=64, num_warps=4)
        exact = values[cols][:, None] * scale.double()[None, :]
        torch.testing.assert_close(out.double(), exact, rtol=0, atol=0)
    xr = torch.randn(2, k)
    _close(linear_triton(xr, qw, block_n=4, block_k=64, num_warps=4), qlinear_exact(xr, qw), 1e-5)


def test_quantized_weight_reports_its_bytes():
    qw = quantize(torch.randn(10, 16), "int8")
    assert isinstance(qw, QuantizedWeight) and qw.nbytes == 10 * 16 + 10 * 4 and qw.shape == (10, 16)
