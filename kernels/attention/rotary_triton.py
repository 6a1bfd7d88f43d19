"""Triton rotary embedding (rotate-half layout); same signature as ``kernels.attention.rotary.rotary_ref``.

When k sits right after q in memory (the fused QKV projection's layout), one launch rotates
the heads of both, writing one (T, H + KVH, D) buffer that q and k are returned as views of.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention.kv_store_triton import to_cache
from kernels.pdl import launch_options, pdl_enter


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


@triton.jit
def _head_norm(x1, x2, w_ptr, offs_d, mask_d, eps, HALF, NORM: tl.constexpr):
    """RMSNorm of whole heads given as their two halves (rows = heads), in the reference's rounding:
    statistics in float32, the normed value cast back, then times the weight."""
    if NORM:
        f1 = x1.to(tl.float32)
        f2 = x2.to(tl.float32)
        rstd = 1.0 / tl.sqrt((tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / (2 * HALF) + eps)
        w1 = tl.load(w_ptr + offs_d, mask=mask_d, other=0.0)
        w2 = tl.load(w_ptr + HALF + offs_d, mask=mask_d, other=0.0)
        x1 = w1[None, :] * (f1 * rstd[:, None]).to(x1.dtype)
        x2 = w2[None, :] * (f2 * rstd[:, None]).to(x2.dtype)
    return x1, x2


@triton.jit
def _rotary_store_kv_kernel(q_ptr, k_ptr, v_ptr, qo_ptr, kc_ptr, vc_ptr, pos_ptr, slot_ptr, cs_ptr, qw_ptr, kw_ptr,
                            eps, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, H, KVH, HALF,
                            NORM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KVH: tl.constexpr,
                            BLOCK_HALF: tl.constexpr, PDL: tl.constexpr = 0):
    """One program per token: q and k heads RMS-normed (with NORM), rotated q to qo, rotated k and v into
    their cache slot."""
    t = tl.program_id(0)
    pdl_enter(PDL)
    pos = tl.load(pos_ptr + t)
    slot = tl.load(slot_ptr + t)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    cos = tl.load(cs_ptr + pos * 2 * HALF + offs_d, mask=mask_d, other=0.0)
    sin = tl.load(cs_ptr + pos * 2 * HALF + HALF + offs_d, mask=mask_d, other=0.0)
    # q heads
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_h[:, None] < H) & mask_d[None, :]
    base = q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :]
    x1, x2 = _head_norm(tl.load(base, mask=mask, other=0.0), tl.load(base + HALF, mask=mask, other=0.0), qw_ptr,
                        offs_d, mask_d, eps, HALF, NORM)
    c = cos.to(x1.dtype)[None, :]
    s = sin.to(x1.dtype)[None, :]
    o = qo_ptr + t * H * 2 * HALF + offs_h[:, None] * 2 * HALF + offs_d[None, :]
    tl.store(o, x1 * c - x2 * s, mask=mask)
    tl.store(o + HALF, x2 * c + x1 * s, mask=mask)
    # k heads, normed and rotated, and v heads, as they are, into the cache slot
    offs_kh = tl.arange(0, BLOCK_KVH)
    kmask = (offs_kh[:, None] < KVH) & mask_d[None, :]
    kbase = k_ptr + t * stride_kt + offs_kh[:, None] * stride_kh + offs_d[None, :]
    k1, k2 = _head_norm(tl.load(kbase, mask=kmask, other=0.0), tl.load(kbase + HALF, mask=kmask, other=0.0), kw_ptr,
                        offs_d, mask_d, eps, HALF, NORM)
    dst = slot * KVH * 2 * HALF + offs_kh[:, None] * 2 * HALF + offs_d[None, :]
    tl.store(kc_ptr + dst, to_cache(k1 * c - k2 * s, kc_ptr), mask=kmask)
    tl.store(kc_ptr + dst + HALF, to_cache(k2 * c + k1 * s, kc_ptr), mask=kmask)
    vbase = v_ptr + t * stride_vt + offs_kh[:, None] * stride_vh + offs_d[None, :]
    tl.store(vc_ptr + dst, to_cache(tl.load(vbase, mask=kmask, other=0.0), vc_ptr), mask=kmask)
    tl.store(vc_ptr + dst + HALF, to_cache(tl.load(vbase + HALF, mask=kmask, other=0.0), vc_ptr), mask=kmask)


def _rotary_store_kv(q, k, v, q_weight, k_weight, eps, positions, cos_sin, k_cache, v_cache, slot_mapping, pdl=0):
    t, h, d = q.shape
    kvh = k.shape[1]
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1, "the head dimension must be contiguous"
    assert k.shape == v.shape == (t, kvh, d) and d % 2 == 0
    assert cos_sin.is_contiguous() and cos_sin.shape[-1] * 2 == d
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[2:] == (kvh, d)
    assert slot_mapping.shape == (t,)
    norm = q_weight is not None
    assert not norm or (q_weight.shape == k_weight.shape == (d,) and q_weight.is_contiguous()
                        and k_weight.is_contiguous())
    out = torch.empty((t, h, d), device=q.device, dtype=q.dtype)
    if t:
        _rotary_store_kv_kernel[(t,)](
            q, k, v, out, k_cache, v_cache, positions, slot_mapping, cos_sin,
            q_weight if norm else out, k_weight if norm else out, eps,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), h, kvh, d // 2,
            NORM=norm, BLOCK_H=triton.next_power_of_2(h), BLOCK_KVH=triton.next_power_of_2(kvh),
            BLOCK_HALF=triton.next_power_of_2(d // 2), **launch_options(pdl, q))
    return out


def rotary_store_kv_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, *, pdl: int = 0,
) -> torch.Tensor:
    """Same signature as ``kernels.attention.rotary.rotary_store_kv_ref``: one launch replaces rotary + store_kv
    (and the copy that made v contiguous). ``pdl``: programmatic dependent launch (kernels/pdl.py)."""
    return _rotary_store_kv(q, k, v, None, None, 0.0, positions, cos_sin, k_cache, v_cache, slot_mapping, pdl)


def norm_rotary_store_kv_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
    positions: torch.Tensor, cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, *, pdl: int = 0,
) -> torch.Tensor:
    """Same signature as ``kernels.attention.rotary.norm_rotary_store_kv_ref``: the q and k head norms (Qwen3) in the
    same launch as rotary + store_kv."""
    return _rotary_store_kv(q, k, v, q_weight, k_weight, eps, positions, cos_sin, k_cache, v_cache, slot_mapping,
                            pdl)
