"""Triton attention over the paged KV cache; same signature as ``kernels.attention.paged_attention_ref``.

``paged_attention_triton``: one program per (query token, KV head) walks the token's causal
context through the block table with an online softmax, so the same kernel serves prefill,
chunked prefill and decode. ``split_kv_attention_triton`` (flash-decoding) also splits each
context into ``num_splits`` ranges processed in parallel and merges them afterwards, which
keeps the GPU busy when a few sequences have long contexts.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_attn_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_ptr, len_ptr, o_ptr, m_ptr, l_ptr,
    stride_qt, stride_qh, stride_bt, stride_ot, stride_oh,
    scale, GROUP, D, BLOCK_SIZE, KVH, SPLIT_LEN,
    G_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
):
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(seq_ptr + t)
    kv_len = tl.load(len_ptr + t)  # keys this query token may see (causal)
    start = split * SPLIT_LEN
    end = tl.minimum(kv_len, start + SPLIT_LEN)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask_g = offs_g < GROUP
    mask_d = offs_d < D
    heads = kvh * GROUP + offs_g
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    n0 = start
    # a while loop, since the bound is loaded at run time (and the CPU interpreter's range() wants scalars)
    while n0 < end:
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        blk = tl.load(bt_ptr + seq * stride_bt + offs_n // BLOCK_SIZE, mask=mask_n, other=0)
        slot = blk.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE
        kv_off = slot[:, None] * (KVH * D) + kvh * D + offs_d[None, :]
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)  # (BLOCK_N, D_PAD)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # (G_PAD, BLOCK_N)
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
        n0 += BLOCK_N
    o_mask = mask_g[:, None] & mask_d[None, :]
    if SPLIT:
        # partial results: unnormalized accumulator plus its running max and sum, merged later
        base = (t * KVH * GROUP + heads) * tl.num_programs(2) + split
        tl.store(m_ptr + base, m_i, mask=mask_g)
        tl.store(l_ptr + base, l_i, mask=mask_g)
        tl.store(o_ptr + base[:, None] * D + offs_d[None, :], acc, mask=o_mask)
    else:
        out = acc / l_i[:, None]
        tl.store(o_ptr + t * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=o_mask)


def _token_tables(context_lens, query_start_loc, device):
    """Per packed query token: its sequence index and how many keys it may attend to."""
    seq_idx, kv_len = [], []
    for i, ctx in enumerate(context_lens):
        n = query_start_loc[i + 1] - query_start_loc[i]
        seq_idx.extend([i] * n)
        kv_len.extend(range(ctx - n + 1, ctx + 1))
    return (torch.tensor(seq_idx, dtype=torch.int32, device=device),
            torch.tensor(kv_len, dtype=torch.int32, device=device))


def _check(q, k_cache, v_cache, block_tables):
    t, h, d = q.shape
    assert q.stride(2) == 1, "the head dimension of q must be contiguous"
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
    assert k_cache.shape[3] == d and h % k_cache.shape[2] == 0, "q heads must be a multiple of KV heads"
    assert block_tables.dtype == torch.int32 and block_tables.is_contiguous()


def paged_attention_triton(
    q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
    block_n: int = 32, num_warps: int = 4, num_stages: int = 2,
):
    _check(q, k_cache, v_cache, block_tables)
    t, h, d = q.shape
    kvh, bs = k_cache.shape[2], k_cache.shape[1]
    out = torch.empty((t, h, d), device=q.device, dtype=q.dtype)
    if t == 0:
        return out
    seq_idx, kv_len = _token_tables(context_lens, query_start_loc, q.device)
    group = h // kvh
    _paged_attn_kernel[(t, kvh, 1)](
        q, k_cache, v_cache, block_tables, seq_idx, kv_len, out, out, out,
        q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        scale, group, d, bs, kvh, max(context_lens),
        G_PAD=triton.next_power_of_2(group), D_PAD=triton.next_power_of_2(d), BLOCK_N=block_n, SPLIT=False,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def split_kv_attention_triton(
    q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
    num_splits: int = 4, block_n: int = 32, num_warps: int = 4, num_stages: int = 2,
):
    _check(q, k_cache, v_cache, block_tables)
    t, h, d = q.shape
    kvh, bs = k_cache.shape[2], k_cache.shape[1]
    if t == 0:
        return torch.empty_like(q)
    seq_idx, kv_len = _token_tables(context_lens, query_start_loc, q.device)
    group = h // kvh
    split_len = triton.cdiv(triton.cdiv(max(context_lens), num_splits), block_n) * block_n
    part = torch.empty((t, h, num_splits, d), device=q.device, dtype=torch.float32)
    m = torch.empty((t, h, num_splits), device=q.device, dtype=torch.float32)
    l = torch.empty_like(m)
    _paged_attn_kernel[(t, kvh, num_splits)](
        q, k_cache, v_cache, block_tables, seq_idx, kv_len, part, m, l,
        q.stride(0), q.stride(1), block_tables.stride(0), 0, 0,
        scale, group, d, bs, kvh, split_len,
        G_PAD=triton.next_power_of_2(group), D_PAD=triton.next_power_of_2(d), BLOCK_N=block_n, SPLIT=True,
        num_warps=num_warps, num_stages=num_stages,
    )
    # Merge the splits; a split past a token's context saw no keys (m = -inf, l = 0) and weighs nothing.
    m_max = m.max(dim=-1, keepdim=True).values
    w = torch.exp(m - m_max)  # (T, H, S)
    num = (part * w[..., None]).sum(dim=2)
    den = (l * w).sum(dim=2)
    return (num / den[..., None]).to(q.dtype)


def make_attention(kind: str, **params):
    """The attention callable for a variant: 'paged' or 'split_kv' with its tunable parameters."""
    fn = {"paged": paged_attention_triton, "split_kv": split_kv_attention_triton}[kind]
    return functools.partial(fn, **params)
