"""Writing new keys and values into the paged KV cache."""
from __future__ import annotations

import torch


def store_kv_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v: (T, KVH, D); k_cache, v_cache: (num_blocks, block_size, KVH, D); slot_mapping: (T,) int64,
    slot = block_id * block_size + offset."""
    kvh, d = k.shape[1], k.shape[2]
    # an FP8 cache (engine/model/precision.py) takes values rounded to e4m3, saturating at +-448
    k_cache.view(-1, kvh, d)[slot_mapping] = k.to(k_cache.dtype)
    v_cache.view(-1, kvh, d)[slot_mapping] = v.to(v_cache.dtype)
