"""Triton SiLU-and-multiply; same signature as ``kernels.pointwise.activation.silu_and_mul_ref``."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def silu_mul(gate, up):
    """silu(gate) * up in the reference's rounding (kernels.activation): gate and up in the activations' dtype,
    the sigmoid in float32, silu rounded to that dtype before the product; the result in that dtype."""
    g = gate.to(tl.float32)
    return (g / (1.0 + tl.exp(-g))).to(gate.dtype) * up


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, I, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    gate = tl.load(x_ptr + row * 2 * I + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * 2 * I + I + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * I + offs, silu_mul(gate, up), mask=mask)


def silu_and_mul_triton(x: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """x: (T, 2I) holding [gate | up]; returns (T, I)."""
    assert x.shape[-1] % 2 == 0, "last dim must hold gate and up halves"
    xr = x.reshape(-1, x.shape[-1]).contiguous()
    i = xr.shape[1] // 2
    out = torch.empty(xr.shape[0], i, device=x.device, dtype=x.dtype)
    block = min(block, triton.next_power_of_2(i))
    _silu_and_mul_kernel[(xr.shape[0], triton.cdiv(i, block))](xr, out, i, BLOCK=block)
    return out.view(*x.shape[:-1], i)
