"""Triton KV-cache store; same signature as ``kernels.attention.kv_store.store_kv_ref``."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def to_cache(x, cache_ptr):
    """x in the cache's element type. For an FP8 (e4m3) cache, rounded here to the nearest e4m3 value (ties to
    even) and saturated at +-448, as torch's conversion does, so that the conversion after is exact: the same
    bytes on every backend (the CPU interpreter's own conversion breaks ties upward, drops the carry into the
    next binade and flushes subnormals)."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        xf = tl.minimum(tl.maximum(x.to(tl.float32), -448.0), 448.0)
        e = tl.maximum(((xf.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)  # the binade (subnormals: -6)
        step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits: 2^(e - 3), exact
        y = xf / step
        r = ((y + 12582912.0) - 12582912.0) * step  # round half to even through 1.5 * 2^23
        x = tl.where(r == 0.0, xf * 0.0, r)  # a zero keeps its sign, as torch's conversion keeps it
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh, H, D,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    mask = (offs_h < H) & (offs_d < D)
    k = tl.load(k_ptr + t * stride_kt + offs_h * stride_kh + offs_d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h * stride_vh + offs_d, mask=mask)
    dst = slot * H * D + offs_h * D + offs_d
    tl.store(kc_ptr + dst, to_cache(k, kc_ptr), mask=mask)
    tl.store(vc_ptr + dst, to_cache(v, vc_ptr), mask=mask)


def store_kv_triton(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v: (T, KVH, D), strided views allowed; caches: (num_blocks, block_size, KVH, D), contiguous."""
    t, h, d = k.shape
    assert v.shape == k.shape and k.stride(2) == 1 and v.stride(2) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[2:] == (h, d)
    assert slot_mapping.shape == (t,)
    if t:
        _store_kv_kernel[(t,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0),
                               v.stride(1), h, d, BLOCK_H=triton.next_power_of_2(h), BLOCK_D=triton.next_power_of_2(d))
