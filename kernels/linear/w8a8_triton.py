"""Triton forms of kernels/linear/w8a8.py: the activation's e4m3 codes and row scale made by the kernel that computes
the activation, then the FP8 GEMM.

- ``add_rms_norm_fp8``: one program per row holds the row (hidden sizes up to 16,384) in registers: the residual
  add (written out: the next layer's residual), the RMSNorm in the reference's rounding (statistics in float32,
  normalized row rounded to the checkpoint's dtype, times the norm's weight in that dtype), the row's largest |h|,
  then the codes; the normalized row itself is never written.
- ``silu_and_mul_fp8`` / ``quantize_rows_e4m3``: one program per row; rows up to ``MAX_ONE_PASS`` wide (the 8B's
  14,336-wide MLP rows) in one pass, the whole row of silu(gate) * up (or the row as it is) in registers of up
  to 16 warps: its largest |a|, then the codes, the inputs read once. Wider rows in two passes over ``BLOCK``
  chunks (the largest |a|, then the codes of the recomputed chunks; the inputs read twice, the second time from
  L2). The product is never written in bf16.

The codes are the float32 quotient rounded to e4m3's 3 mantissa bits first (kernels/linear/qmma_triton.py's
``_round_e4m3``), so the conversion is exact and equals torch's round-to-nearest-even on the GPU and in the CPU
interpreter alike: the tests compare codes with the plain-torch references.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.linear.qmma_triton import _round_e4m3
from kernels.linear.quant import FP8_MAX, QuantizedWeight
from kernels.linear.w8a8 import MAX_NORM_D, fp8_rows_mm

MAX_ONE_PASS = 16384  # widest row (rounded up to a power of two) quantized in one pass from registers



@triton.jit
def _add_rms_norm_fp8_kernel(x_ptr, r_ptr, w_ptr, sum_ptr, q_ptr, s_ptr, D, eps, stride_x, stride_r, stride_sum,
                             stride_q, FP8_MAX: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    # every operation in float32, rounded to the checkpoint's dtype where the reference's tensors are in it (a sum
    # or product of two bf16 values is exact in float32, so one rounding gives torch's bf16 result)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    s = (tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32) + x.to(tl.float32)).to(x.dtype)
    tl.store(sum_ptr + row * stride_sum + offs, s, mask=mask)
    sf = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(sf * sf, axis=0) / D + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    h = (w * (sf * rstd).to(x.dtype).to(tl.float32)).to(x.dtype).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(h), axis=0) / FP8_MAX, 1e-12)
    tl.store(s_ptr + row, scale)
    q = _round_e4m3(tl.div_rn(h, scale))
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _act_chunk(x_row, offs, m, width, ACT: tl.constexpr):
    """The chunk of the row to quantize, in float32: silu(gate) * up in the reference's rounding (silu rounded to
    the activations' dtype, the product too), or the row as it is."""
    g = tl.load(x_row + offs, mask=m, other=0.0)
    if ACT:
        gf = g.to(tl.float32)
        silu = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
        up = tl.load(x_row + width + offs, mask=m, other=0.0).to(tl.float32)
        return (silu * up).to(g.dtype).to(tl.float32)
    return g.to(tl.float32)


@triton.jit
def _quant_row_kernel(x_ptr, q_ptr, s_ptr, stride_x, stride_q, width: tl.constexpr, FP8_MAX: tl.constexpr,
                      ACT: tl.constexpr, BLOCK: tl.constexpr):
    """``_quant_rows_kernel`` in one pass: the whole row (BLOCK >= width) in registers, its inputs read once."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < width
    a = _act_chunk(x_ptr + row * stride_x, offs, m, width, ACT)
    scale = tl.maximum(tl.max(tl.abs(a), axis=0) / FP8_MAX, 1e-12)
    tl.store(s_ptr + row, scale)
    q = _round_e4m3(tl.div_rn(a, scale))
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=m)


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, stride_x, stride_q, width: tl.constexpr, FP8_MAX: tl.constexpr,
                       ACT: tl.constexpr,
                       BLOCK: tl.constexpr):
    """ACT 1: x holds [gate | up], each ``width`` wide, and the row quantized is silu(gate) * up; ACT 0: x itself."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, width, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        m = offs < width
        a = _act_chunk(x_row, offs, m, width, ACT)
        amax = tl.maximum(amax, tl.abs(a))
    scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, 1e-12)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, width, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        m = offs < width
        a = _act_chunk(x_row, offs, m, width, ACT)
        q = _round_e4m3(tl.div_rn(a, scale))
        tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=m)


def _rows2d(name: str, x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2:
        raise ValueError(f"{name} takes (T, K) rows, got shape {tuple(x.shape)}")
    return x if x.stride(-1) == 1 else x.contiguous()


def add_rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, residual: (T, D), norm_weight: (D,) -> (e4m3 codes (T, D), float32 scales (T, 1), x + residual)."""
    x, residual = _rows2d("add_rms_norm_fp8", x), _rows2d("add_rms_norm_fp8", residual)
    t, d = x.shape
    if residual.shape != x.shape or norm_weight.shape != (d,):
        raise ValueError(f"residual {tuple(residual.shape)} and norm weight {tuple(norm_weight.shape)} do not "
                         f"match x {tuple(x.shape)}")
    if d > MAX_NORM_D:
        raise ValueError(f"rows of {d} exceed the {MAX_NORM_D} the norm kernel holds")
    q = torch.empty(t, d, device=x.device, dtype=torch.float8_e4m3fn)
    s = torch.empty(t, 1, device=x.device, dtype=torch.float32)
    summed = torch.empty_like(x)
    if t:
        block = triton.next_power_of_2(d)
        _add_rms_norm_fp8_kernel[(t,)](x, residual, norm_weight, summed, q, s, d, eps, x.stride(0),
                                       residual.stride(0), summed.stride(0), q.stride(0), FP8_MAX=FP8_MAX,
                                       BLOCK_D=block, num_warps=4 if block <= 2048 else 8 if block <= 8192 else 16)
    return q, s, summed


def _quant_rows(x: torch.Tensor, width: int, act: int, block: int, one_pass: bool | None, warps: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    t = x.shape[0]
    q = torch.empty(t, width, device=x.device, dtype=torch.float8_e4m3fn)
    s = torch.empty(t, 1, device=x.device, dtype=torch.float32)
    row = triton.next_power_of_2(width)
    one_pass = row <= MAX_ONE_PASS if one_pass is None else one_pass
    if t and one_pass:
        if row > MAX_ONE_PASS:
            raise ValueError(f"rows of {width} exceed the {MAX_ONE_PASS} one pass holds in registers")
        _quant_row_kernel[(t,)](x, q, s, x.stride(0), q.stride(0), width=width, FP8_MAX=FP8_MAX, ACT=act, BLOCK=row,
                                num_warps=warps or max(4, min(32, row // 512)))
    elif t:
        block = min(block, row)
        _quant_rows_kernel[(t,)](x, q, s, x.stride(0), q.stride(0), width=width, FP8_MAX=FP8_MAX, ACT=act, BLOCK=block,
                                 num_warps=warps or (4 if block <= 1024 else 8))
    return q, s


def silu_and_mul_fp8(x: torch.Tensor, block: int = 2048, one_pass: bool | None = None, warps: int | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (T, 2I) holding [gate | up] -> (e4m3 codes of silu(gate) * up (T, I), float32 scales (T, 1)).
    ``one_pass``: the whole row in registers (default: where it fits, MAX_ONE_PASS), else two passes of ``block``;
    ``warps``: a program's warps (default: by the row's width)."""
    x = _rows2d("silu_and_mul_fp8", x)
    if x.shape[1] % 2:
        raise ValueError(f"silu_and_mul_fp8 takes [gate | up] rows of even width, got {x.shape[1]}")
    return _quant_rows(x, x.shape[1] // 2, 1, block, one_pass, warps)


def quantize_rows_e4m3(x: torch.Tensor, block: int = 2048, one_pass: bool | None = None, warps: int | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (T, K) -> (e4m3 codes (T, K), float32 scales (T, 1)): kernels.linear.quant.quantize_rows in one launch."""
    x = _rows2d("quantize_rows_e4m3", x)
    return _quant_rows(x, x.shape[1], 0, block, one_pass, warps)


def norm_linear_w8a8(x, residual, norm_weight, eps, weight: QuantizedWeight, bias=None, fast_accum=False):
    """``norm_linear``'s signature: (linear(rms_norm(x + residual)), x + residual), W8A8 (``fast_accum``: as
    ``fp8_rows_mm``'s)."""
    q, s, summed = add_rms_norm_fp8(x, residual, norm_weight, eps)
    return fp8_rows_mm(q, s, weight, bias, fast_accum), summed


def act_linear_w8a8(x, weight: QuantizedWeight, fast_accum=False):
    """``act_linear``'s signature: linear(silu(gate) * up), W8A8."""
    q, s = silu_and_mul_fp8(x)
    return fp8_rows_mm(q, s, weight, None, fast_accum)


def linear_w8a8(x, weight: QuantizedWeight, bias=None, fast_accum=False):
    """``linear``'s signature: x's codes in one launch, then the W8A8 GEMM."""
    q, s = quantize_rows_e4m3(x)
    return fp8_rows_mm(q, s, weight, bias, fast_accum)
