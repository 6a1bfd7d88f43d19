"""Attention over the paged KV cache, one signature for prefill, chunked prefill and decode."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


def device_ints(values, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.tensor(values, dtype, device)`` that does not wait for the stream: on a GPU the host copy is pinned
    and copied without blocking (a copy from pageable memory first waits for all queued work, so a step that made
    several could not launch ahead of the GPU)."""
    # a Python list through numpy: a third of the time torch.tensor takes over the list itself
    host = torch.from_numpy(np.asarray(values, dtype=np.int64 if dtype == torch.int64 else np.int32)) \
        if dtype in (torch.int64, torch.int32) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@dataclass
class AttentionMetadata:
    """Where the packed tokens of one step live in the paged KV cache.

    Host lists serve code that loops in Python; the device tensors serve kernels and CUDA
    graphs, whose replays must not read host values.
    """

    slot_mapping: torch.Tensor  # (T,) int64: KV-pool slot of each new token
    block_tables: torch.Tensor  # (B, max_blocks) int32: each sequence's blocks; padding entries are ignored
    context_lens: list[int]  # B: tokens in each sequence's context including its new ones
    query_start_loc: list[int]  # B + 1: offsets of each sequence's new tokens in the packed batch
    context_lens_t: torch.Tensor  # (B,) int32, the same on the device
    query_start_loc_t: torch.Tensor  # (B + 1,) int32
    max_query_len: int  # 1 means a pure decode batch
    max_context_len: int  # an upper bound on context_lens (kernels size their work by it)
    # per-step device tensors a kernel derives from the host lists, built by its first layer and read by the rest
    # (a host-to-device copy from pageable memory waits for the stream: one per layer serialises every launch)
    derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def build(cls, slot_mapping, block_tables, context_lens, query_start_loc, device) -> "AttentionMetadata":
        return cls(
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            context_lens=context_lens,
            query_start_loc=query_start_loc,
            context_lens_t=device_ints(context_lens, torch.int32, device),
            query_start_loc_t=device_ints(query_start_loc, torch.int32, device),
            max_query_len=max(b - a for a, b in zip(query_start_loc, query_start_loc[1:])),
            max_context_len=max(context_lens),
        )


def paged_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its whole cached context.

    q: (T, H, D), the new tokens of B sequences packed back to back.
    k_cache, v_cache: (num_blocks, block_size, KVH, D), already holding the new tokens.
    Sequence i's queries are the last (query_start_loc[i+1] - query_start_loc[i]) positions
    of its context of context_lens[i] tokens. Returns (T, H, D).
    """
    out = torch.empty_like(q)
    block_size, kvh, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // kvh  # query heads per KV head; head h reads KV head h // group
    qsl = meta.query_start_loc
    for i, ctx in enumerate(meta.context_lens):
        qs, qe = qsl[i], qsl[i + 1]
        n = qe - qs
        blocks = meta.block_tables[i, : (ctx + block_size - 1) // block_size].long()
        # an FP8 cache's values widened to the queries' dtype
        k = k_cache.index_select(0, blocks).view(-1, kvh, d)[:ctx].permute(1, 2, 0).to(q.dtype)  # (KVH, D, ctx)
        v = v_cache.index_select(0, blocks).view(-1, kvh, d)[:ctx].transpose(0, 1).to(q.dtype)  # (KVH, ctx, D)
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


def compose_rotary_attention(rotary_store_kv, norm_rotary_store_kv, attention, q, k, v, q_weight, k_weight, eps,
                             positions, cos_sin, k_cache, v_cache, meta, scale):
    """``rotary_attention`` from its parts: ``norm_rotary_store_kv`` when norm weights are given (else
    ``rotary_store_kv``), then ``attention`` (the reference's parts, or a variant's own)."""
    if q_weight is None:
        q = rotary_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache, meta.slot_mapping)
    else:
        q = norm_rotary_store_kv(q, k, v, q_weight, k_weight, eps, positions, cos_sin, k_cache, v_cache,
                                 meta.slot_mapping)
    return attention(q, k_cache, v_cache, meta, scale)


def rotary_attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
    eps: float, positions: torch.Tensor, cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float,
) -> torch.Tensor:
    """The attention block between the QKV and output projections: q and k heads RMS-normed when weights are
    given (Qwen3), rotated, k and v written into the cache, then ``paged_attention_ref``. q: (T, H, D), k, v:
    (T, KVH, D) (strided views of the QKV projection allowed). Returns (T, H, D)."""
    from kernels.attention.rotary import norm_rotary_store_kv_ref, rotary_store_kv_ref

    return compose_rotary_attention(rotary_store_kv_ref, norm_rotary_store_kv_ref, paged_attention_ref, q, k, v,
                                    q_weight, k_weight, eps, positions, cos_sin, k_cache, v_cache, meta, scale)
