"""Triton rotary embedding (rotate-half layout); same signature as ``kernels.rotary.rotary_ref``.

When k sits right after q in memory (the fused QKV projection's layout), one launch rotates
the heads of both, writing one (T, H + KVH, D) buffer that q and k are returned as views of.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(x_ptr, out_ptr, pos_ptr, cs_ptr, stride_xt, stride_xh, H, HALF,
                   BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < H) & (offs_d[None, :] < HALF)
    cos = tl.load(cs_ptr + pos * 2 * HALF + offs_d, mask=offs_d < HALF, other=0.0)
    sin = tl.load(cs_ptr + pos * 2 * HALF + HALF + offs_d, mask=offs_d < HALF, other=0.0)
    base = x_ptr + t * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    c = cos.to(x1.dtype)[None, :]
    s = sin.to(x1.dtype)[None, :]
    o = out_ptr + t * H * 2 * HALF + offs_h[:, None] * 2 * HALF + offs_d[None, :]
    tl.store(o, x1 * c - x2 * s, mask=mask)
    tl.store(o + HALF, x2 * c + x1 * s, mask=mask)


def _rotate(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    t, h, d = x.shape
    assert x.stride(2) == 1, "the head dimension must be contiguous"
    out = torch.empty((t, h, d), device=x.device, dtype=x.dtype)
    if t:
        _rotary_kernel[(t,)](x, out, positions, cos_sin, x.stride(0), x.stride(1), h, d // 2,
                             BLOCK_H=triton.next_power_of_2(h), BLOCK_HALF=triton.next_power_of_2(d // 2))
    return out


def rotary_triton(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: (T, H, D), k: (T, KVH, D) (strided views allowed), positions: (T,), cos_sin: (P, 2, D/2) float32."""
    assert cos_sin.is_contiguous() and cos_sin.shape[-1] * 2 == q.shape[-1]
    t, h, d = q.shape
    adjacent = (
        k.shape[0] == t and k.shape[2] == d and k.stride() == q.stride() and q.stride(1) == d
        and k.data_ptr() == q.data_ptr() + h * d * q.element_size()
    )
    if adjacent:  # one launch over q's and k's heads together
        both = q.as_strided((t, h + k.shape[1], d), q.stride())
        out = _rotate(both, positions, cos_sin)
        return out[:, :h], out[:, h:]
    return _rotate(q, positions, cos_sin), _rotate(k, positions, cos_sin)
