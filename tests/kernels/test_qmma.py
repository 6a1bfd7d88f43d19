"""The tensor-core kernel for quantized weights (kernels/linear/qmma_triton.py) against its float64 reference and the
float64 product of the unquantized activations, with each prologue and K split, on fresh random inputs
(TRITON_INTERPRET=1 on CPU); the e4m3 rounding of the activations against torch's conversion; the linear
operations' routing to it (``mma``)."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kernels.linear import linear_triton as lt
from kernels.pointwise.activation import silu_and_mul_ref
from kernels.pointwise.norm import fused_add_rms_norm_ref
from kernels.linear.qmma_triton import (ADD_RMS_NORM, NONE, SILU_MUL, _round_e4m3, candidates, fused_norm_ref, qmma, qmma_ref,
                                 split_for)
from kernels.linear.quant import qlinear_exact, quantize

TILES = {"block_n": 32, "block_k": 64, "num_warps": 4, "num_stages": 2}


@triton.jit
def _round_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, _round_e4m3(tl.load(x_ptr + offs, mask=offs < n)), mask=offs < n)


def test_e4m3_rounding_equals_torch_conversion():
    torch.manual_seed(0)
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    grid = grid[torch.isfinite(grid)].unique()  # every finite e4m3 value
    mids = (grid[1:] + grid[:-1]) / 2  # exact ties: round to even
    rand = (torch.rand(4000) * 2 - 1) * torch.exp2(torch.randint(-12, 9, (4000,)).float()) * 1.75
    x = torch.cat([grid, mids, rand, torch.tensor([448.0, -448.0, 0.0, 2.0 ** -10, 2.0 ** -6 - 2.0 ** -12])])
    x = x.clamp(-448, 448).contiguous()
    y = torch.empty_like(x)
    _round_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    want = x.to(torch.float8_e4m3fn).to(torch.float32)
    bad = (y != want).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} values differ, e.g. {x[bad[:4]].tolist()} -> {y[bad[:4]].tolist()} " \
                             f"against {want[bad[:4]].tolist()}"


CASES = [  # rows, N, K, prologue, split (0: from the shape)
    (1, 64, 256, NONE, 1), (3, 100, 320, NONE, 2), (5, 64, 192, SILU_MUL, 3), (17, 70, 128, ADD_RMS_NORM, 0),
    (33, 40, 256, ADD_RMS_NORM, 2), (2, 96, 200, NONE, 4), (1, 48, 320, ADD_RMS_NORM, 1),
]


@pytest.mark.parametrize("fused", [0, 1])
@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("case", CASES)
def test_qmma_against_references(kind, case, fused):
    m, n, k, prologue, split = case
    qw = quantize(torch.randn(n, k) * 0.05, kind)
    bias = torch.randn(n) if prologue == NONE else None
    x = torch.randn(m, 2 * k if prologue == SILU_MUL else k) * 2
    r, nw = torch.randn(m, k), torch.rand(k) + 0.5
    tiles = {**TILES, "split_k": split, "fused": fused}
    out, summed = qmma(x, qw, bias, prologue, tiles, r=r, norm_weight=nw, eps=1e-5,
                       k=k if prologue == SILU_MUL else None)
    rows = None
    if prologue == SILU_MUL:
        h = silu_and_mul_ref(x)
    elif prologue == ADD_RMS_NORM:
        h, summed_ref = fused_add_rms_norm_ref(x, r, nw, 1e-5)
        assert torch.equal(summed, summed_ref)
    else:
        h = x
    codes_of = h
    if fused and prologue == ADD_RMS_NORM:  # quantized before its 1 / rms, applied at the end
        codes_of, rows, _ = fused_norm_ref(x, r, nw, 1e-5)
    scale = qlinear_exact(h, qw, bias).abs().max().item()
    # float32 activations: the kernel's sums against float64's, only their rounding
    err_ref = (out.double() - qmma_ref(codes_of, qw, TILES["block_k"], bias, rows)).abs().max().item()
    assert err_ref <= 2e-5 * scale
    # the activations' own quantization: e4m3 keeps 3 mantissa bits, int8 7 (SiLU-and-multiply's heavy tails take a
    # chunk's scale: 0.0106 seen on these shapes; 0.017 on the 8B's, bench/gpu/precision/qmma.py)
    err = (out.double() - qlinear_exact(h, qw, bias)).abs().max().item()
    assert err <= (0.05 if kind == "fp8" else 0.02) * scale
    # the split's arrival counts were reset: a second call gives the same output
    again, _ = qmma(x, qw, bias, prologue, tiles, r=r, norm_weight=nw, eps=1e-5, k=k if prologue == SILU_MUL else None)
    assert torch.equal(out, again)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_qmma_bfloat16_activations(seed):
    torch.manual_seed(seed)
    qw = quantize(torch.randn(128, 256, dtype=torch.bfloat16) * 0.05, "fp8")
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    out, _ = qmma(x, qw, None, NONE, {**TILES, "split_k": 2})
    assert out.dtype == torch.bfloat16
    scale = qlinear_exact(x, qw).abs().max().item()
    # the output's bf16 rounding: one unit in the last place (the CPU interpreter truncates to bfloat16; the GPU
    # rounds to nearest, half of that)
    assert (out.double() - qmma_ref(x, qw, 64)).abs().max().item() <= 2 ** -7 * scale


def test_linear_ops_route_rows_to_the_tensor_core_kernel():
    torch.manual_seed(1)
    qw = quantize(torch.randn(64, 128) * 0.05, "int8")
    params = dict(mma=2, mma_block_n=32, mma_block_k=64, mma_split=2, mma_warps=4, mma_stages=2)
    x, r, nw = torch.randn(3, 128), torch.randn(3, 128), torch.rand(128) + 0.5
    tiles = {"block_n": 32, "block_k": 64, "split_k": 2, "num_warps": 4, "num_stages": 2}
    # from ``mma`` rows: the kernel
    assert torch.equal(lt.linear_triton(x, qw, **params), qmma(x, qw, None, NONE, tiles)[0])
    got, summed = lt.norm_linear_triton(x, r, nw, 1e-5, qw, **params)
    want = qmma(x, qw, None, ADD_RMS_NORM, tiles, r=r, norm_weight=nw, eps=1e-5)
    assert torch.equal(got, want[0]) and torch.equal(summed, want[1])
    gu = torch.randn(3, 256)
    assert torch.equal(lt.act_linear_triton(gu, qw, **params), qmma(gu, qw, None, SILU_MUL, tiles, k=128)[0])
    # fewer rows: the GEMV, as without ``mma``; plain weights never take it
    one = x[:1]
    assert torch.equal(lt.linear_triton(one, qw, **params), lt.linear_triton(one, qw))
    # ``mma_min_numel``: one row takes the kernel only on weights that large; more rows always
    at_size, above = {**params, "mma": 1, "mma_min_numel": 64 * 128}, {**params, "mma": 1, "mma_min_numel": 64 * 129}
    assert torch.equal(lt.linear_triton(one, qw, **at_size), qmma(one, qw, None, NONE, tiles)[0])
    assert torch.equal(lt.linear_triton(one, qw, **above), lt.linear_triton(one, qw))
    assert torch.equal(lt.linear_triton(x, qw, **above), qmma(x, qw, None, NONE, tiles)[0])
    w = torch.randn(64, 128)
    assert torch.equal(lt.linear_triton(x, w, **params), lt.linear_triton(x, w))


def test_autotuning_candidates():
    got = candidates(28672, 4096)
    # each tile with the splits for about 264, 528 and 1,056 programs (distinct), each with and without the fusion
    assert {(c["block_n"], c["block_k"], c["split_k"]) for c in got} >= {(128, 256, 1), (128, 256, 2), (128, 256, 4)}
    assert {c["fused"] for c in got} == {0, 1}
    assert len({tuple(sorted(c.items())) for c in got}) == len(got)


def test_split_fills_the_device_and_keeps_two_chunks_per_program():
    assert split_for(4096, 4096, 64, 256) == 4  # 64 groups -> 256 programs
    assert split_for(4096, 14336, 64, 256) == 4
    assert split_for(28672, 4096, 64, 256) == 1  # 448 groups already
    assert split_for(64, 256, 64, 256) == 1  # one chunk: nothing to split


def test_prologue_codes_are_the_gemvs():
    # the linear ops pass their own prologue codes to the tensor-core kernel
    assert (NONE, SILU_MUL, ADD_RMS_NORM) == (lt.NONE, lt.SILU_MUL, lt.ADD_RMS_NORM)
