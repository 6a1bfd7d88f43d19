"""Triton KV-cache store; same signature as ``kernels.kv_store.store_kv_ref``."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


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
    tl.store(kc_ptr + dst, k, mask=mask)
    tl.store(vc_ptr + dst, v, mask=mask)


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
