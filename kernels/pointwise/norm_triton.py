"""Triton RMSNorm and RMSNorm fused with the residual add; same signatures as ``kernels.pointwise.norm``."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import launch_options, pdl_enter


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, D, eps, HAS_RES: tl.constexpr, BLOCK_D: tl.constexpr,
                     PDL: tl.constexpr = 0):
    row = tl.program_id(0)
    pdl_enter(PDL)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(x_ptr + row * D + offs, mask=mask, other=0.0)
    if HAS_RES:
        x = tl.load(res_ptr + row * D + offs, mask=mask, other=0.0) + x
        tl.store(sum_ptr + row * D + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / D
    y = (xf * tl.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * D + offs, w * y, mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, *, pdl: int = 0) -> torch.Tensor:
    """x: (..., D), weight: (D,). ``pdl``: programmatic dependent launch (kernels/pdl.py)."""
    d = x.shape[-1]
    assert weight.shape == (d,), f"weight {tuple(weight.shape)} does not match last dim {d}"
    xr = _rows(x)
    out = torch.empty_like(xr)
    _rms_norm_kernel[(xr.shape[0],)](xr, xr, weight, out, out, d, eps, HAS_RES=False,
                                     BLOCK_D=triton.next_power_of_2(d), **launch_options(pdl, xr))
    return out.view(x.shape)


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *, pdl: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual); x, residual: (T, D)."""
    d = x.shape[-1]
    assert residual.shape == x.shape and weight.shape == (d,)
    xr, rr = _rows(x), _rows(residual)
    out, summed = torch.empty_like(xr), torch.empty_like(xr)
    _rms_norm_kernel[(xr.shape[0],)](xr, rr, weight, out, summed, d, eps, HAS_RES=True,
                                     BLOCK_D=triton.next_power_of_2(d), **launch_options(pdl, xr))
    return out.view(x.shape), summed.view(x.shape)
