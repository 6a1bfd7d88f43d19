"""The W8A8 FP8 path (kernels/linear/w8a8.py, kernels/linear/w8a8_triton.py): the activations' e4m3 codes made by the
norm and activation kernels against the plain-torch references (float32: the same codes; bfloat16: the CPU
interpreter truncates where the GPU rounds, so within the format's step), the projections against their references
and the float64 product, bad inputs, and the FP8 operations' routing of many rows to it (TRITON_INTERPRET=1 on
CPU; torch's row-wise scaled GEMM runs on the CPU too)."""
from __future__ import annotations

import pytest
import torch

from engine.model import precision
from kernels.linear import w8a8
from kernels.linear import w8a8_triton as wt
from kernels.linear.quant import qlinear_exact, quantize, quantize_rows
from kernels.pointwise.activation import silu_and_mul_ref
from kernels.pointwise.norm import fused_add_rms_norm_ref


def _codes_agree(q, s, q0, s0, max_share=0.005):
    """Scales within float32 rounding; codes equal but for a share ``max_share`` of ties moved by that rounding,
    those one e4m3 step apart."""
    assert torch.allclose(s, s0, rtol=1e-6, atol=0)
    a, b = q.float(), q0.float()
    differ = a != b
    assert differ.float().mean().item() <= max_share, f"{differ.sum().item()} of {a.numel()} codes differ"
    step = torch.maximum(b.abs(), torch.full_like(b, 2.0 ** -6)) * 2.0 ** -3  # one unit of e4m3's mantissa
    assert ((a - b).abs() <= step * 1.001)[differ].all()


@pytest.mark.parametrize("t,d", [(1, 64), (7, 320), (33, 1000)])
def test_norm_codes_equal_the_reference_in_float32(t, d):
    torch.manual_seed(t * d)
    x, r = torch.randn(t, d) * 3, torch.randn(t, d)
    nw = torch.rand(d) + 0.5
    q, s, summed = wt.add_rms_norm_fp8(x, r, nw, 1e-5)
    q0, s0, summed0 = w8a8.add_rms_norm_fp8_ref(x, r, nw, 1e-5)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (t, 1)
    assert torch.equal(summed, summed0)
    _codes_agree(q, s, q0, s0)


@pytest.mark.parametrize("t,width,block", [(1, 64, 64), (5, 300, 128), (9, 1000, 256)])
@pytest.mark.parametrize("one_pass", [True, False])  # the whole row in registers, or two passes of ``block``
def test_activation_and_row_codes_equal_the_reference_in_float32(t, width, block, one_pass):
    torch.manual_seed(width + block)
    gu = torch.randn(t, 2 * width) * 2
    q, s = wt.silu_and_mul_fp8(gu, block=block, one_pass=one_pass)
    q0, s0 = w8a8.silu_and_mul_fp8_ref(gu)
    _codes_agree(q, s, q0, s0)  # torch's silu and the kernel's exp may differ in the last bit
    x = torch.randn(t, width) * 5
    q, s = wt.quantize_rows_e4m3(x, block=block, one_pass=one_pass)
    q0, s0 = quantize_rows(x)
    assert torch.equal(s, s0) and torch.equal(q.float(), q0.float())


def test_rows_too_wide_for_one_pass_are_refused_or_take_two():
    x = torch.zeros(1, wt.MAX_ONE_PASS + 1)
    with pytest.raises(ValueError, match="one pass"):
        wt.quantize_rows_e4m3(x, one_pass=True)
    q, s = wt.quantize_rows_e4m3(x, block=4096)  # the default: two passes for a row this wide
    assert q.shape == x.shape and s.shape == (1, 1)


def test_bfloat16_codes_within_the_format_step():
    torch.manual_seed(3)
    x, r = (torch.randn(6, 256) * 2).bfloat16(), torch.randn(6, 256).bfloat16()
    nw = (torch.rand(256) + 0.5).bfloat16()
    q, s, summed = wt.add_rms_norm_fp8(x, r, nw, 1e-5)
    h, summed0 = fused_add_rms_norm_ref(x, r, nw, 1e-5)
    assert summed.dtype == torch.bfloat16
    assert (summed.float() - summed0.float()).abs().max() <= 2 ** -7 * summed0.float().abs().max()
    deq = q.float() * s
    # e4m3 keeps 3 mantissa bits: half a step (1/16) of each value, plus the interpreter's bf16 truncation
    assert ((deq - h.float()).abs() <= h.float().abs() / 14 + s * 2 ** -9).all()
    gu = (torch.randn(6, 512) * 2).bfloat16()
    q, s = wt.silu_and_mul_fp8(gu, block=128)
    a = silu_and_mul_ref(gu).float()
    # the interpreter truncates silu and the product to bf16 (two units of 2^-7), then e4m3 rounds (1/16)
    assert ((q.float() * s - a).abs() <= a.abs() / 11 + s * 2 ** -9).all()


@pytest.mark.parametrize("t,n,k", [(65, 64, 128), (80, 48, 320)])
def test_projections_against_references_and_the_float64_product(t, n, k):
    torch.manual_seed(t + n)
    qw = quantize(torch.randn(n, k) * 0.05, "fp8")
    bias = torch.randn(n)
    x, r, nw = torch.randn(t, k) * 2, torch.randn(t, k), torch.rand(k) + 0.5
    gu = torch.randn(t, 2 * k)
    got, summed = wt.norm_linear_w8a8(x, r, nw, 1e-5, qw, bias)
    want, summed0 = w8a8.norm_linear_w8a8_ref(x, r, nw, 1e-5, qw, bias)
    h, _ = fused_add_rms_norm_ref(x, r, nw, 1e-5)
    exact = qlinear_exact(h, qw, bias)
    scale = exact.abs().max().item()
    assert torch.equal(summed, summed0)
    assert (got - want).abs().max().item() <= 0.02 * scale  # codes that differ by a tie's step, at most
    assert (got.double() - exact).abs().max().item() <= 0.06 * scale  # e4m3 activations: 3 mantissa bits
    got, want = wt.act_linear_w8a8(gu, qw), w8a8.act_linear_w8a8_ref(gu, qw)
    exact = qlinear_exact(silu_and_mul_ref(gu), qw)
    assert (got - want).abs().max().item() <= 0.02 * exact.abs().max().item()
    assert (got.double() - exact).abs().max().item() <= 0.06 * exact.abs().max().item()
    got, want = wt.linear_w8a8(x, qw, bias), w8a8.linear_w8a8_ref(x, qw, bias)
    assert torch.equal(got, want)


def test_bad_inputs_raise_clear_errors():
    qw8 = quantize(torch.randn(32, 64), "int8")
    qf8 = quantize(torch.randn(32, 64), "fp8")
    with pytest.raises(ValueError, match="takes FP8 weights"):
        w8a8.fp8_rows_mm(*quantize_rows(torch.randn(4, 64)), qw8)
    with pytest.raises(ValueError, match="columns"):
        w8a8.fp8_rows_mm(*quantize_rows(torch.randn(4, 32)), qf8)
    with pytest.raises(ValueError, match=r"\(T, K\) rows"):
        wt.quantize_rows_e4m3(torch.randn(2, 3, 64))
    with pytest.raises(ValueError, match="do not match"):
        wt.add_rms_norm_fp8(torch.randn(4, 64), torch.randn(4, 32), torch.ones(64), 1e-5)
    with pytest.raises(ValueError, match="even width"):
        wt.silu_and_mul_fp8(torch.randn(4, 63))
    assert not w8a8.supports(torch.randn(4, 64), qw8) and w8a8.supports(torch.randn(4, 64), qf8)


def test_fp8_operations_route_many_rows_to_w8a8(monkeypatch):
    torch.manual_seed(5)
    w = torch.randn(64, 128) * 0.05
    qw = quantize(w, "fp8")
    calls = []

    def inner(name):
        def op(*args, **kwargs):
            calls.append(name)
            return name
        return op

    monkeypatch.setattr(precision, "w8a8_device", lambda x: True)  # the CPU stands in for an FP8 GPU
    lin, norm_lin, act_lin = precision._w8a8(inner("linear"), inner("norm_linear"), inner("act_linear"),
                                             lambda p: qw if p is w else p)
    few, many = torch.randn(3, 128), torch.randn(precision.W8A8_MIN_ROWS, 128)
    r, nw = torch.randn_like(many), torch.rand(128) + 0.5
    assert lin(few, w) == "linear" and norm_lin(few, few, nw, 1e-5, w)[0] == "n"
    assert act_lin(torch.randn(3, 256), w) == "act_linear"
    assert calls == ["linear", "norm_linear", "act_linear"]
    assert torch.equal(lin(many, w), w8a8.linear_w8a8_ref(many, qw))
    out, summed = norm_lin(many, r, nw, 1e-5, w)
    want, summed0 = w8a8.norm_linear_w8a8_ref(many, r, nw, 1e-5, qw)
    assert torch.equal(summed, summed0) and (out - want).abs().max() <= 0.02 * want.abs().max()
    gu = torch.randn(precision.W8A8_MIN_ROWS, 256)
    want = w8a8.act_linear_w8a8_ref(gu, qw)
    assert (act_lin(gu, w) - want).abs().max() <= 0.02 * want.abs().max()
    plain = torch.randn(64, 128)  # a weight with no FP8 copy (a router) keeps the operation given
    assert lin(many, plain) == "linear" and len(calls) == 4


def test_fast_accumulation_reaches_the_fp8_gemm(monkeypatch):
    torch.manual_seed(6)
    w = torch.randn(64, 128) * 0.05
    qw = quantize(w, "fp8")
    seen, scaled_mm = [], torch._scaled_mm

    def spy(*args, **kwargs):
        seen.append(kwargs.get("use_fast_accum", False))
        return scaled_mm(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    monkeypatch.setattr(precision, "w8a8_device", lambda x: True)
    x, gu = torch.randn(precision.W8A8_MIN_ROWS, 128), torch.randn(precision.W8A8_MIN_ROWS, 256)
    r, nw = torch.randn_like(x), torch.rand(128) + 0.5
    for fast in (False, True):
        lin, norm_lin, act_lin = precision._w8a8(None, None, None, lambda p: qw, fast)
        outs = (lin(x, w), norm_lin(x, r, nw, 1e-5, w)[0], act_lin(gu, w))
        assert seen[-3:] == [fast] * 3
        # the CPU's FP8 product has one accumulation: the same numbers either way
        assert all(torch.equal(o, ref) for o, ref in zip(outs, (w8a8.linear_w8a8_ref(x, qw),
                                                                 wt.norm_linear_w8a8(x, r, nw, 1e-5, qw)[0],
                                                                 wt.act_linear_w8a8(gu, qw))))
