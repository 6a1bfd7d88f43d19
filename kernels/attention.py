"""Attention over the paged KV cache, one signature for prefill, chunked prefill and decode."""
from __future__ import annotations

import torch


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
    block_size, kvh, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // kvh  # query heads per KV head; head h reads KV head h // group
    for i, ctx in enumerate(context_lens):
        qs, qe = query_start_loc[i], query_start_loc[i + 1]
        n = qe - qs
        blocks = block_tables[i, : (ctx + block_size - 1) // block_size].long()
        k = k_cache.index_select(0, blocks).view(-1, kvh, d)[:ctx].permute(1, 2, 0)  # (KVH, D, ctx)
        v = v_cache.index_select(0, blocks).view(-1, kvh, d)[:ctx].transpose(0, 1)  # (KVH, ctx, D)
        qi = q[qs:qe].view(n, kvh, group, d).permute(1, 0, 2, 3).reshape(kvh, n * group, d)
        scores = torch.matmul(qi, k).float() * scale  # (KVH, n * group, ctx)
        if n > 1:
            # Query j sits at position ctx - n + j and sees keys 0..ctx - n + j.
            qpos = torch.arange(ctx - n, ctx, device=q.device).repeat_interleave(group)[:, None]
            scores.masked_fill_(torch.arange(ctx, device=q.device)[None, :] > qpos, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        o = torch.matmul(probs, v)  # (KVH, n * group, D)
        out[qs:qe] = o.view(kvh, n, group, d).permute(1, 0, 2, 3).reshape(n, kvh * group, d)
    return out
