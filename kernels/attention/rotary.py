"""Rotary position embedding (the rotate-half, "neox" layout used by Llama and Qwen)."""
from __future__ import annotations

import torch


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: (T, H, D), k: (T, KVH, D), positions: (T,), cos_sin: (P, 2, D/2) float32.

    Returns rotated copies of q and k.
    """
    cs = cos_sin[positions]  # (T, 2, D/2)
    cos = torch.cat((cs[:, 0], cs[:, 0]), dim=-1).to(q.dtype)[:, None, :]  # (T, 1, D)
    sin = torch.cat((cs[:, 1], cs[:, 1]), dim=-1).to(q.dtype)[:, None, :]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def rotary_store_kv_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Rotates q and k, writes the rotated k and v into the paged cache; returns the rotated q, (T, H, D).

    q: (T, H, D), k, v: (T, KVH, D) (strided views allowed); caches: (num_blocks, block_size, KVH, D);
    slot_mapping: (T,) int64.
    """
    from kernels.attention.kv_store import store_kv_ref

    q, k = rotary_ref(q, k, positions, cos_sin)
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping)
    return q


def norm_rotary_store_kv_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
    positions: torch.Tensor, cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Per-head RMSNorm of q and k (Qwen3's q_norm / k_norm, weights (D,)), then ``rotary_store_kv_ref``."""
    from kernels.pointwise.norm import rms_norm_ref

    return rotary_store_kv_ref(rms_norm_ref(q, q_weight, eps), rms_norm_ref(k, k_weight, eps), v, positions, cos_sin,
                               k_cache, v_cache, slot_mapping)
