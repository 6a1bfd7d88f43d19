"""Attention over the paged KV cache, one signature for prefill, chunked prefill and decode."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: list[int],
    query_start_loc: list[int],
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its whole cached context.

    q: (T, H, D), the new tokens of B sequences packed back to back.
    k_cache, v_cache: (num_blocks, block_size, KVH, D), already holding the new tokens.
    block_tables: (B, max_blocks) int32; entries past a sequence's blocks are ignored.
    context_lens[i]: tokens in sequence i's context including its new ones.
    query_start_loc: B + 1 offsets into q; sequence i's queries are the last
    (query_start_loc[i+1] - query_start_loc[i]) positions of its context.
    Returns (T, H, D).
    """
    out = torch.empty_like(q)
    block_size, kvh = k_cache.shape[1], k_cache.shape[2]
    heads = q.shape[1]
    for i, ctx in enumerate(context_lens):
        qs, qe = query_start_loc[i], query_start_loc[i + 1]
        n = qe - qs
        nblocks = (ctx + block_size - 1) // block_size
        blocks = block_tables[i, :nblocks].long()
        k = k_cache[blocks].reshape(-1, kvh, k_cache.shape[-1])[:ctx]  # (ctx, KVH, D)
        v = v_cache[blocks].reshape(-1, kvh, v_cache.shape[-1])[:ctx]
        qi = q[qs:qe].transpose(0, 1)  # (H, n, D)
        k = k.transpose(0, 1).repeat_interleave(heads // kvh, dim=0)  # (H, ctx, D)
        v = v.transpose(0, 1).repeat_interleave(heads // kvh, dim=0)
        # Query j sits at position ctx - n + j and sees keys 0..ctx - n + j.
        qpos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
        kpos = torch.arange(ctx, device=q.device)[None, :]
        mask = kpos <= qpos  # (n, ctx)
        o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale)
        out[qs:qe] = o.transpose(0, 1)
    return out
