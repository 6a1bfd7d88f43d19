"""Triton attention over the paged KV cache; same signature as ``kernels.attention.attention.paged_attention_ref``.

Two kernels, chosen per batch:
- decode (every sequence has one new token): one program per (sequence, KV head[, split]);
  the KV head's query heads form the rows of one ``tl.dot`` tile, so each key and value is
  read once per KV head. It reads sequence lengths from device tensors only, so it can be
  captured in a CUDA graph. With ``num_splits > 1`` (flash-decoding) each context is split
  into ranges processed in parallel and merged afterwards (one more launch), which keeps the
  GPU busy when a few sequences have long contexts, or one sequence has few KV heads
  (``num_splits=0`` picks the splits from the batch size). On a GPU its loop over keys is a
  counted loop, whose loads the compiler pipelines (``num_stages``); the CPU interpreter runs it as
  a while loop (its range() takes no bound loaded at run time).
- decode with the rotary in front (``rotary_attention_triton``): the same programs also RMS-norm
  (Qwen3) and rotate their query heads and the new token's key, which the program whose range
  holds the last position writes into the cache and attends to from registers; the splits are
  merged by the merge kernel after it, or by the last of them to finish. One or two launches for
  what is otherwise three.
- prefill / chunked prefill (any sequence has several new tokens): kernels/attention/prefill_triton.py.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.attention.attention import AttentionMetadata
from kernels.counters import ArrivalCounters, fresh_counters
from kernels.timing import interpreted
from kernels.attention.kv_store_triton import to_cache
from kernels.pdl import launch_options, pdl_enter
from kernels.attention.rotary_triton import _head_norm, _rotary_store_kv
from kernels.attention.prefill_triton import PREFILL_TILES, dot as _dot, kv_tile, prefill_attention


@triton.jit
def _softmax_step(s, m_i, l_i):
    """A tile of scores (rows, keys) into a running max and sum (online softmax): returns the tile's weights,
    the factor that rescales what was accumulated before, and the new max and sum."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _decode_tile(q, acc, m_i, l_i, k_ptr, v_ptr, bt_ptr, b, stride_bt, n0, end, kvh, offs_d, mask_d, scale, D,
                 BLOCK_SIZE, KVH, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """One tile of BLOCK_N keys from ``n0`` (below ``end``) of sequence ``b`` into the running (acc, max, sum)."""
    k, v, offs_n, mask_n = kv_tile(k_ptr, v_ptr, bt_ptr, b, stride_bt, n0, end, kvh, offs_d, mask_d, D,
                                   BLOCK_SIZE, KVH, q.dtype, BLOCK_N)
    s = _dot(q, tl.trans(k), IEEE) * scale  # (G_PAD, BLOCK_N)
    s = tl.where(mask_n[None, :], s, float("-inf"))
    p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i)
    return acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE), m_i, l_i


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, o_ptr, m_ptr, l_ptr,
    stride_qt, stride_qh, stride_bt, scale, GROUP, D, BLOCK_SIZE, KVH,
    G_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
    PDL: tl.constexpr = 0, COUNTED: tl.constexpr = 0, F16: tl.constexpr = 0,
):
    """``F16``: the queries in float16, so an FP8 cache's tiles widen to float16 (one conversion instruction per
    pair of e4m3 values on Hopper; to bfloat16 they pass through float32) and the products run in float16."""
    b = tl.program_id(0)
    pdl_enter(PDL)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    n_splits = tl.num_programs(2)
    kv_len = tl.load(ctx_ptr + b)
    split_len = tl.cdiv(tl.cdiv(kv_len, n_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(kv_len, start + split_len)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask_g = offs_g < GROUP
    mask_d = offs_d < D
    heads = kvh * GROUP + offs_g
    q = tl.load(q_ptr + b * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)
    if F16:
        q = q.to(tl.float16)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    if COUNTED:  # a counted loop: the compiler pipelines its loads (num_stages)
        for n0 in range(start, end, BLOCK_N):
            acc, m_i, l_i = _decode_tile(q, acc, m_i, l_i, k_ptr, v_ptr, bt_ptr, b, stride_bt, n0, end, kvh,
                                         offs_d, mask_d, scale, D, BLOCK_SIZE, KVH, BLOCK_N, IEEE)
    else:  # the CPU interpreter's range() takes no bound loaded at run time
        n0 = start
        while n0 < end:
            acc, m_i, l_i = _decode_tile(q, acc, m_i, l_i, k_ptr, v_ptr, bt_ptr, b, stride_bt, n0, end, kvh,
                                         offs_d, mask_d, scale, D, BLOCK_SIZE, KVH, BLOCK_N, IEEE)
            n0 += BLOCK_N
    o_mask = mask_g[:, None] & mask_d[None, :]
    if SPLIT:
        # partial result: unnormalized accumulator with its running max and sum, merged afterwards
        base = (b * KVH * GROUP + heads) * n_splits + split
        tl.store(m_ptr + base, m_i, mask=mask_g)
        tl.store(l_ptr + base, l_i, mask=mask_g)
        tl.store(o_ptr + base[:, None] * D + offs_d[None, :], acc, mask=o_mask)
    else:
        out = acc / l_i[:, None]
        tl.store(o_ptr + b * (KVH * GROUP * D) + heads[:, None] * D + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _merge_kernel(part_ptr, m_ptr, l_ptr, o_ptr, S, D, S_PAD: tl.constexpr, D_PAD: tl.constexpr,
                  PDL: tl.constexpr = 0):
    """One program per (sequence, head): the splits' partial results weighed by their running max and sum.
    A split past a short context saw no keys (m = -inf, l = 0) and weighs nothing."""
    row = tl.program_id(0)  # sequence * heads + head
    pdl_enter(PDL)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask_s = offs_s < S
    m = tl.load(m_ptr + row * S + offs_s, mask=mask_s, other=float("-inf"))
    l = tl.load(l_ptr + row * S + offs_s, mask=mask_s, other=0.0)
    w = tl.exp(m - tl.max(m, axis=0))
    w = tl.where(mask_s & (l > 0), w, 0.0)
    part = tl.load(part_ptr + (row * S + offs_s)[:, None] * D + offs_d[None, :],
                   mask=mask_s[:, None] & (offs_d[None, :] < D), other=0.0)
    out = tl.sum(part * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(o_ptr + row * D + offs_d, out.to(o_ptr.dtype.element_ty), mask=offs_d < D)


# ``num_splits=0``: split each context so a decode batch runs about this many programs (a batch of one
# sequence with 4-8 KV heads otherwise leaves most SMs idle), and at most this many splits
AUTO_PROGRAMS, AUTO_MAX_SPLITS = 32, 16


def _check(q, k_cache, v_cache, meta: AttentionMetadata):
    t, h, d = q.shape
    assert q.stride(2) == 1, "the head dimension of q must be contiguous"
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
    assert k_cache.shape[3] == d and h % k_cache.shape[2] == 0, "q heads must be a multiple of KV heads"
    bt = meta.block_tables
    assert bt.dtype == torch.int32 and bt.is_contiguous() and bt.shape[0] == meta.context_lens_t.shape[0]


def _splits(num_splits: int, b: int, kvh: int) -> int:
    """``num_splits``, or for 0 (automatic) about AUTO_PROGRAMS programs whatever the batch (fixed per graph size)."""
    return num_splits or max(1, min(AUTO_MAX_SPLITS, -(-AUTO_PROGRAMS // (b * kvh))))


def _split_parts(b: int, h: int, num_splits: int, d: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The split decode kernels' partial results: unnormalized accumulators (b, h, splits, d), running max and
    running sum (b, h, splits), float32."""
    part = torch.empty((b, h, num_splits, d), device=device, dtype=torch.float32)
    m = torch.empty((b, h, num_splits), device=device, dtype=torch.float32)
    return part, m, torch.empty_like(m)


def _merge(part, m, l, out, pdl) -> None:
    b, h, num_splits, d = part.shape
    _merge_kernel[(b * h,)](part, m, l, out, num_splits, d, S_PAD=triton.next_power_of_2(num_splits),
                            D_PAD=max(16, triton.next_power_of_2(d)), **launch_options(pdl, out))


def _widened_to_f16(fp8_f16, q, k_cache) -> int:
    """The decode kernels' ``F16``: asked for, over an FP8 cache, with bfloat16 queries."""
    return int(bool(fp8_f16) and k_cache.element_size() == 1 and q.dtype == torch.bfloat16)


def _decode(q, k_cache, v_cache, meta, scale, num_splits, block_n, num_warps, num_stages, pdl, fp8_f16=0):
    b, h, d = q.shape
    kvh, bs = k_cache.shape[2], k_cache.shape[1]
    group = h // kvh
    num_splits = _splits(num_splits, b, kvh)
    common = dict(G_PAD=max(16, triton.next_power_of_2(group)), D_PAD=max(16, triton.next_power_of_2(d)),
                  BLOCK_N=block_n, IEEE=q.dtype == torch.float32, num_warps=num_warps, num_stages=num_stages,
                  COUNTED=not interpreted(), F16=_widened_to_f16(fp8_f16, q, k_cache), **launch_options(pdl, q))
    args = (q.stride(0), q.stride(1), meta.block_tables.stride(0), scale, group, d, bs, kvh)
    out = torch.empty((b, h, d), device=q.device, dtype=q.dtype)
    if num_splits == 1:
        _decode_kernel[(b, kvh, 1)](q, k_cache, v_cache, meta.block_tables, meta.context_lens_t, out, out, out,
                                    *args, SPLIT=False, **common)
        return out
    part, m, l = _split_parts(b, h, num_splits, d, q.device)
    _decode_kernel[(b, kvh, num_splits)](q, k_cache, v_cache, meta.block_tables, meta.context_lens_t, part, m, l,
                                         *args, SPLIT=True, **common)
    _merge(part, m, l, out, pdl)
    return out


def paged_attention_triton(
    q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
    num_splits: int = 1, block_n: int = 32, block_m: int = PREFILL_TILES["block_m"], num_warps: int = 4,
    num_stages: int = 2, pdl: int = 0, prefill_block_n: int = PREFILL_TILES["block_n"],
    prefill_warps: int = PREFILL_TILES["num_warps"], prefill_stages: int = PREFILL_TILES["num_stages"],
    fp8_f16: int = 0,
):
    """Decode batches go to the decode kernel (split into ``num_splits`` KV ranges; 0: by the batch's size;
    ``block_n`` keys per tile, ``num_warps``, ``num_stages``), others to the prefill kernel (``block_m`` query
    rows by ``prefill_block_n`` keys per tile, ``prefill_warps``, ``prefill_stages``: its own tiles, since a
    prefill's work is a matrix product where decode's is a stream of the cache). ``pdl``: the decode kernels
    with programmatic dependent launch (kernels/pdl.py). ``fp8_f16``: with an FP8 cache and bfloat16 queries,
    decode widens the cache's tiles to float16 instead (``_decode_kernel``'s ``F16``)."""
    _check(q, k_cache, v_cache, meta)
    if q.shape[0] == 0:
        return torch.empty_like(q)
    if meta.max_query_len == 1:
        return _decode(q, k_cache, v_cache, meta, scale, num_splits, block_n, num_warps, num_stages, pdl, fp8_f16)
    return prefill_attention(q, k_cache, v_cache, meta, scale, block_m, prefill_block_n, prefill_warps,
                             prefill_stages)


def split_kv_attention_triton(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, num_splits: int = 4,
                              **params):
    """Flash-decoding: ``paged_attention_triton`` with the decode context split ``num_splits`` ways."""
    return paged_attention_triton(q, k_cache, v_cache, meta, scale, num_splits=num_splits, **params)


@triton.jit
def _cache_tile(kc_ptr, vc_ptr, bt_row, blk, n0, end, kvh, offs_d, mask_d, HALF, BLOCK_SIZE, KVH,
                BLOCK_N: tl.constexpr):
    """Keys and values n0 .. n0 + BLOCK_N (below end) of one KV head as their two rotary halves, from the cache
    slots that ``blk`` (their block table entries) gives; and the next tile's block table entries."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask = (offs_n < end)[:, None] & mask_d[None, :]
    slot_n = blk.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE
    kv_off = slot_n[:, None] * (KVH * 2 * HALF) + kvh * 2 * HALF + offs_d[None, :]
    ka = tl.load(kc_ptr + kv_off, mask=mask, other=0.0)
    kz = tl.load(kc_ptr + kv_off + HALF, mask=mask, other=0.0)
    va = tl.load(vc_ptr + kv_off, mask=mask, other=0.0)
    vz = tl.load(vc_ptr + kv_off + HALF, mask=mask, other=0.0)
    nxt = offs_n + BLOCK_N
    return ka, kz, va, vz, tl.load(bt_row + nxt // BLOCK_SIZE, mask=nxt < end, other=0)


@triton.jit
def _rotary_decode_kernel(
    q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, pos_ptr, slot_ptr, cs_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr,
    o_ptr, part_ptr, m_ptr, l_ptr, cnt_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_bt, eps, scale,
    GROUP, HALF, BLOCK_SIZE, KVH,
    NORM: tl.constexpr, G_PAD: tl.constexpr, GM_PAD: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    S_PAD: tl.constexpr, SPLIT: tl.constexpr, MERGE: tl.constexpr, IEEE: tl.constexpr, EARLY: tl.constexpr,
    PDL: tl.constexpr = 0, F16: tl.constexpr = 0,
):
    """One program per (sequence, KV head, split) of a decode batch. Heads are handled as their two rotary
    halves (d < HALF and HALF + d), so the rotation needs no shuffle within a head. The cache below the new
    token was written by earlier steps and the sequence's length, position and block table before this step's
    kernels, so with EARLY the split's first tile of keys and values is requested before the wait
    (``pdl_enter``): after it, one round trip for the new query, key and value. The next tile's block table
    entries are read while the current one is computed. ``F16``: as ``_decode_kernel``'s (an FP8 cache's tiles
    widened to float16, the rotated query heads narrowed to it for the products)."""
    b = tl.program_id(0)
    if not EARLY:
        pdl_enter(PDL)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    n_splits = tl.num_programs(2)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, HALF_PAD)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HALF
    heads = kvh * GROUP + offs_g
    qmask = mask_g[:, None] & mask_d[None, :]
    kmask = mask_d[None, :]
    # (with EARLY before the wait) the sequence's length and position, this split's first block table entries and
    # tile of the cache, and the rotation at the token's position
    kv_len = tl.load(ctx_ptr + b)
    pos = tl.load(pos_ptr + b)
    split_len = tl.cdiv(tl.cdiv(kv_len, n_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(kv_len, start + split_len)
    last = kv_len - 1  # the new token's position: its key and value are the ones in registers
    cached_end = tl.minimum(end, last)
    bt_row = bt_ptr + b * stride_bt
    offs_n = start + tl.arange(0, BLOCK_N)
    blk = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=offs_n < cached_end, other=0)
    cos = tl.load(cs_ptr + pos * 2 * HALF + offs_d, mask=mask_d, other=0.0)
    sin = tl.load(cs_ptr + pos * 2 * HALF + HALF + offs_d, mask=mask_d, other=0.0)
    ka, kz, va, vz, blk = _cache_tile(kc_ptr, vc_ptr, bt_row, blk, start, cached_end, kvh, offs_d, mask_d, HALF,
                                      BLOCK_SIZE, KVH, BLOCK_N)
    if EARLY:
        pdl_enter(PDL)
    # after it: this KV head's query heads, the new key and value (the projection before wrote them)
    qb = q_ptr + b * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q1 = tl.load(qb, mask=qmask, other=0.0)
    q2 = tl.load(qb + HALF, mask=qmask, other=0.0)
    kb = k_ptr + b * stride_kt + kvh * stride_kh + offs_d[None, :]
    k1 = tl.load(kb, mask=kmask, other=0.0)
    k2 = tl.load(kb + HALF, mask=kmask, other=0.0)
    vb = v_ptr + b * stride_vt + kvh * stride_vh + offs_d[None, :]
    v1 = to_cache(tl.load(vb, mask=kmask, other=0.0), vc_ptr)
    v2 = to_cache(tl.load(vb + HALF, mask=kmask, other=0.0), vc_ptr)
    # the query heads and the new key normed and rotated as kernels.attention.rotary_triton does
    q1, q2 = _head_norm(q1, q2, qw_ptr, offs_d, mask_d, eps, HALF, NORM)
    c = cos.to(q1.dtype)[None, :]
    s = sin.to(q1.dtype)[None, :]
    q1, q2 = q1 * c - q2 * s, q2 * c + q1 * s
    k1, k2 = _head_norm(k1, k2, kw_ptr, offs_d, mask_d, eps, HALF, NORM)
    k1, k2 = to_cache(k1 * c - k2 * s, kc_ptr), to_cache(k2 * c + k1 * s, kc_ptr)

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc1 = tl.zeros([G_PAD, HALF_PAD], tl.float32)
    acc2 = tl.zeros([G_PAD, HALF_PAD], tl.float32)
    if F16:
        qa, qz = q1.to(tl.float16), q2.to(tl.float16)
    else:
        qa, qz = q1, q2
    n0 = start
    while n0 < cached_end:  # a while loop: the bound is loaded at run time
        mask_n = n0 + tl.arange(0, BLOCK_N) < cached_end
        ka, kz, va, vz = ka.to(qa.dtype), kz.to(qa.dtype), va.to(qa.dtype), vz.to(qa.dtype)  # an FP8 cache widened
        sc = (_dot(qa, tl.trans(ka), IEEE) + _dot(qz, tl.trans(kz), IEEE)) * scale  # (G_PAD, BLOCK_N)
        sc = tl.where(mask_n[None, :], sc, float("-inf"))
        p, alpha, m_i, l_i = _softmax_step(sc, m_i, l_i)
        acc1 = acc1 * alpha[:, None] + _dot(p.to(va.dtype), va, IEEE)
        acc2 = acc2 * alpha[:, None] + _dot(p.to(vz.dtype), vz, IEEE)
        n0 += BLOCK_N
        ka, kz, va, vz, blk = _cache_tile(kc_ptr, vc_ptr, bt_row, blk, n0, cached_end, kvh, offs_d, mask_d, HALF,
                                          BLOCK_SIZE, KVH, BLOCK_N)  # masked past the end
    if (last >= start) & (last < end):  # this split holds the new token: attend to it, and cache it
        dst = tl.load(slot_ptr + b) * (KVH * 2 * HALF) + kvh * 2 * HALF + offs_d[None, :]
        tl.store(kc_ptr + dst, k1, mask=kmask)
        tl.store(kc_ptr + dst + HALF, k2, mask=kmask)
        tl.store(vc_ptr + dst, v1, mask=kmask)
        tl.store(vc_ptr + dst + HALF, v2, mask=kmask)
        s_new = (tl.sum(q1.to(tl.float32) * k1.to(tl.float32), axis=1)
                 + tl.sum(q2.to(tl.float32) * k2.to(tl.float32), axis=1)) * scale
        p, alpha, m_i, l_i = _softmax_step(s_new[:, None], m_i, l_i)  # a tile of one key
        pv = p.to(q1.dtype).to(tl.float32)  # v1 holds the cache's dtype (FP8 included): the value as cached
        acc1 = acc1 * alpha[:, None] + pv * v1.to(tl.float32)
        acc2 = acc2 * alpha[:, None] + pv * v2.to(tl.float32)
    if SPLIT:
        # partial result (unnormalized accumulator, running max and sum), merged by ``_merge_kernel`` after, or
        # with MERGE by the last split of this (sequence, KV head) to finish (its acquire sees every split's
        # partials), which then resets the counter
        row = (b * KVH * GROUP + heads) * n_splits
        tl.store(m_ptr + row + split, m_i, mask=mask_g)
        tl.store(l_ptr + row + split, l_i, mask=mask_g)
        pb = part_ptr + (row + split)[:, None] * (2 * HALF) + offs_d[None, :]
        tl.store(pb, acc1, mask=qmask)
        tl.store(pb + HALF, acc2, mask=qmask)
        if MERGE:
            tl.debug_barrier()
            cnt = cnt_ptr + b * KVH + kvh
            if tl.atomic_add(cnt, 1) == n_splits - 1:
                # every split's partials in one round trip: (heads, splits[, half]) tiles
                offs_h = tl.arange(0, GM_PAD)
                mask_h = offs_h < GROUP
                offs_s = tl.arange(0, S_PAD)
                sm = mask_h[:, None] & (offs_s < n_splits)[None, :]
                rows = (b * KVH * GROUP + kvh * GROUP + offs_h)[:, None] * n_splits + offs_s[None, :]
                poff = rows[:, :, None] * (2 * HALF) + offs_d[None, None, :]
                pm = sm[:, :, None] & mask_d[None, None, :]
                ms = tl.load(m_ptr + rows, mask=sm, other=float("-inf"), cache_modifier=".cg")
                ls = tl.load(l_ptr + rows, mask=sm, other=0.0, cache_modifier=".cg")
                p1 = tl.load(part_ptr + poff, mask=pm, other=0.0, cache_modifier=".cg")
                p2 = tl.load(part_ptr + poff + HALF, mask=pm, other=0.0, cache_modifier=".cg")
                w = tl.exp(ms - tl.max(ms, axis=1)[:, None])
                w = tl.where(sm & (ls > 0), w, 0.0)  # a split past a short context saw no keys: weighs nothing
                denom = tl.sum(ls * w, axis=1)[:, None]
                o1 = tl.sum(p1 * w[:, :, None], axis=1) / denom
                o2 = tl.sum(p2 * w[:, :, None], axis=1) / denom
                ooff = b * (KVH * GROUP * 2 * HALF) + (kvh * GROUP + offs_h)[:, None] * (2 * HALF) + offs_d[None, :]
                omask = mask_h[:, None] & mask_d[None, :]
                tl.store(o_ptr + ooff, o1.to(o_ptr.dtype.element_ty), mask=omask)
                tl.store(o_ptr + ooff + HALF, o2.to(o_ptr.dtype.element_ty), mask=omask)
                tl.atomic_xchg(cnt, 0)
    else:
        out_off = b * (KVH * GROUP * 2 * HALF) + heads[:, None] * (2 * HALF) + offs_d[None, :]
        tl.store(o_ptr + out_off, (acc1 / l_i[:, None]).to(o_ptr.dtype.element_ty), mask=qmask)
        tl.store(o_ptr + out_off + HALF, (acc2 / l_i[:, None]).to(o_ptr.dtype.element_ty), mask=qmask)


def rotary_attention_triton(
    q, k, v, q_weight, k_weight, eps: float, positions, cos_sin, k_cache, v_cache, meta: AttentionMetadata,
    scale: float, *, num_splits: int = 0, merge_by_last: int = 0, block_n: int = 32,
    block_m: int = PREFILL_TILES["block_m"], num_warps: int = 4, num_stages: int = 2, cache_before_wait: int = 1,
    pdl: int = 0, counters=None, prefill_block_n: int = PREFILL_TILES["block_n"],
    prefill_warps: int = PREFILL_TILES["num_warps"], prefill_stages: int = PREFILL_TILES["num_stages"],
    fp8_f16: int = 0,
):
    """Same contract as ``kernels.attention.attention.rotary_attention_ref``. A decode batch takes ``_rotary_decode_kernel``
    (``num_splits`` as ``paged_attention_triton``'s, 0: by the batch's size; the splits merged by the merge
    kernel after it, or by the last of them to finish with ``merge_by_last``; with ``cache_before_wait`` each
    split's first tile of the cache requested before the dependent-launch wait); others the
    rotary + KV-store kernel, then ``paged_attention_triton``. ``counters(n, device)``: the split merge's
    arrival counters (default: zeroed per call; ``make_rotary_attention`` keeps one buffer). ``fp8_f16``: as
    ``paged_attention_triton``'s."""
    t, h, d = q.shape
    kvh = k.shape[1]
    if meta.max_query_len != 1 or t == 0:
        q = _rotary_store_kv(q, k, v, q_weight, k_weight, eps, positions, cos_sin, k_cache, v_cache,
                             meta.slot_mapping, pdl)
        return paged_attention_triton(q, k_cache, v_cache, meta, scale, num_splits=num_splits, block_n=block_n,
                                      block_m=block_m, num_warps=num_warps, num_stages=num_stages, pdl=pdl,
                                      prefill_block_n=prefill_block_n, prefill_warps=prefill_warps,
                                      prefill_stages=prefill_stages, fp8_f16=fp8_f16)
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1, "the head dimension must be contiguous"
    assert k.shape == v.shape == (t, kvh, d) and d % 2 == 0 and h % kvh == 0
    assert cos_sin.is_contiguous() and cos_sin.shape[-1] * 2 == d
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
    assert k_cache.shape[2:] == (kvh, d) and meta.slot_mapping.shape == (t,)
    bt = meta.block_tables
    assert bt.dtype == torch.int32 and bt.is_contiguous() and bt.shape[0] == t == meta.context_lens_t.shape[0]
    norm = q_weight is not None
    assert not norm or (q_weight.shape == k_weight.shape == (d,) and q_weight.is_contiguous()
                        and k_weight.is_contiguous())
    group = h // kvh
    num_splits = _splits(num_splits, t, kvh)
    out = torch.empty((t, h, d), device=q.device, dtype=q.dtype)
    if num_splits > 1:
        part, m, l = _split_parts(t, h, num_splits, d, q.device)
        cnt = (counters or fresh_counters)(t * kvh, q.device) if merge_by_last else out
    else:
        part = m = l = cnt = out
    _rotary_decode_kernel[(t, kvh, num_splits)](
        q, k, v, q_weight if norm else out, k_weight if norm else out, positions, meta.slot_mapping, cos_sin,
        k_cache, v_cache, bt, meta.context_lens_t, out, part, m, l, cnt,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), bt.stride(0), eps, scale,
        group, d // 2, k_cache.shape[1], kvh,
        NORM=norm, G_PAD=max(16, triton.next_power_of_2(group)), GM_PAD=triton.next_power_of_2(group),
        HALF_PAD=max(16, triton.next_power_of_2(d // 2)), BLOCK_N=block_n, S_PAD=triton.next_power_of_2(num_splits),
        SPLIT=num_splits > 1, MERGE=bool(merge_by_last), IEEE=q.dtype == torch.float32,
        EARLY=bool(cache_before_wait), F16=_widened_to_f16(fp8_f16, q, k_cache), num_warps=num_warps,
        num_stages=num_stages, **launch_options(pdl, q))
    if num_splits > 1 and not merge_by_last:
        _merge(part, m, l, out, pdl)
    return out


def make_rotary_attention(**params):
    """The rotary_attention callable for a variant: ``rotary_attention_triton`` with its tunable parameters and
    this table's own arrival counters."""
    return functools.partial(rotary_attention_triton, **params, counters=ArrivalCounters())


def make_attention(kind: str, **params):
    """The attention callable for a variant: 'paged' or 'split_kv' with its tunable parameters."""
    fn = {"paged": paged_attention_triton, "split_kv": split_kv_attention_triton}[kind]
    return functools.partial(fn, **params)
