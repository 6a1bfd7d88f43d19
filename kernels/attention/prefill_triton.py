"""Triton attention of prefill and chunked-prefill batches over the paged KV cache (the decode kernels:
kernels/attention/attention_triton.py, which sends batches with several new tokens of a sequence here).

One program per (tile of BLOCK_M new tokens of one sequence, query head) walks the sequence's causal context
through the block table with an online softmax in base 2. The keys up to the tile's first query position are
visible to every row of the tile: those whole tiles of keys run without a mask, only the diagonal ones are
masked. Tiles are launched longest context first, so the short ones fill the tail of the grid. On a GPU the
loops over keys are counted loops, whose loads the compiler pipelines (``num_stages``); the CPU interpreter runs
the same tiles in while loops (its range() takes no bound loaded at run time).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention.attention import AttentionMetadata, device_ints
from kernels.timing import interpreted

LOG2E = 1.4426950408889634  # scores in base 2 (exp2)
# 128 query rows by 128 keys, 8 warps, 2 stages: the fastest of eight tiles on an H200 for 4 x 2,048-token prompts on
# the 8B's heads (234 TFLOP/s, 0.84x flash SDPA on contiguous heads; 128 x 64 with 3 stages 199; the tiles it had
# before, 32 x 128 unpipelined, 102: bench/results/2026-12-06-h200-w8a8-attention.md)
PREFILL_TILES = {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 2}


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    """tl.dot, in IEEE float32 for float32 inputs (the tests' references); the attention kernels' too."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def kv_tile(k_ptr, v_ptr, bt_ptr, seq, stride_bt, n0, end, kvh, offs_d, mask_d, D, BLOCK_SIZE, KVH, dtype,
            BLOCK_N: tl.constexpr):
    """(keys, values, their positions, which are below ``end``): BLOCK_N cached positions from ``n0`` of sequence
    ``seq`` through its block table, (BLOCK_N, D_PAD) each, an FP8 cache's values widened to ``dtype``."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < end
    blk = tl.load(bt_ptr + seq * stride_bt + offs_n // BLOCK_SIZE, mask=mask_n, other=0)
    slot = blk.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE
    kv_off = slot[:, None] * (KVH * D) + kvh * D + offs_d[None, :]
    kv_mask = mask_n[:, None] & mask_d[None, :]
    k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0).to(dtype)
    v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0).to(dtype)
    return k, v, offs_n, mask_n


@triton.jit
def _prefill_tile(q, acc, m_i, l_i, k_ptr, v_ptr, bt_ptr, seq, stride_bt, n0, end, pos_m, kvh, offs_d, mask_d,
                  qk_scale, D, BLOCK_SIZE, KVH, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, CAUSAL: tl.constexpr):
    """One tile of BLOCK_N keys from ``n0`` (below ``end``) into the running (acc, max, sum); scores in base 2
    (``qk_scale`` holds log2(e)). ``CAUSAL``: mask the keys after each row's position (the diagonal tiles);
    without it, every key of the tile is visible to every row."""
    k, v, offs_n, mask_n = kv_tile(k_ptr, v_ptr, bt_ptr, seq, stride_bt, n0, end, kvh, offs_d, mask_d, D,
                                   BLOCK_SIZE, KVH, q.dtype, BLOCK_N)
    s = dot(q, tl.trans(k), IEEE) * qk_scale  # (BLOCK_M, BLOCK_N)
    if CAUSAL:
        s = tl.where(mask_n[None, :] & (offs_n[None, :] <= pos_m[:, None]), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, IEEE)
    return acc, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, bt_ptr, ctx_ptr, qsl_ptr, tile_seq_ptr, tile_m_ptr,
    stride_qt, stride_qh, stride_bt, qk_scale, GROUP, D, BLOCK_SIZE, KVH, H,
    BLOCK_M: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, COUNTED: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kvh = head // GROUP
    seq = tl.load(tile_seq_ptr + tile)
    m0 = tl.load(tile_m_ptr + tile)  # first new token of this tile, counted within the sequence
    q_start = tl.load(qsl_ptr + seq)
    n_new = tl.load(qsl_ptr + seq + 1) - q_start
    ctx = tl.load(ctx_ptr + seq)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    mask_m = offs_m < n_new
    first = ctx - n_new + m0  # position of the tile's first query row in its sequence
    pos_m = first + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    mask_d = offs_d < D
    q = tl.load(q_ptr + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    end = tl.minimum(ctx, first + BLOCK_M)  # keys the last row of the tile may see
    # keys up to the first row's position are visible to every row: whole tiles of them without a mask, the
    # rest (the diagonal) masked
    full = (first + 1) // BLOCK_N * BLOCK_N
    if COUNTED:  # counted loops: the compiler pipelines their loads (num_stages)
        for n0 in range(0, full, BLOCK_N):
            acc, m_i, l_i = _prefill_tile(q, acc, m_i, l_i, k_ptr, v_ptr, bt_ptr, seq, stride_bt, n0, end, pos_m,
                                          kvh, offs_d, mask_d, qk_scale, D, BLOCK_SIZE, KVH, BLOCK_N, IEEE, False)
        for n0 in range(full, end, BLOCK_N):
            acc, m_i, l_i = _prefill_tile(q, acc, m_i, l_i, k_ptr, v_ptr, bt_ptr, seq, stride_bt, n0, end, pos_m,
                                          kvh, offs_d, mask_d, qk_scale, D, BLOCK_SIZE, KVH, BLOCK_N, IEEE, True)
    else:  # the CPU interpreter's range() takes no bound loaded at run time
        n0 = end * 0
        while n0 < full:
            acc, m_i, l_i = _prefill_tile(q, acc, m_i, l_i, k_ptr, v_ptr, bt_ptr, seq, stride_bt, n0, end, pos_m,
                                          kvh, offs_d, mask_d, qk_scale, D, BLOCK_SIZE, KVH, BLOCK_N, IEEE, False)
            n0 += BLOCK_N
        while n0 < end:
            acc, m_i, l_i = _prefill_tile(q, acc, m_i, l_i, k_ptr, v_ptr, bt_ptr, seq, stride_bt, n0, end, pos_m,
                                          kvh, offs_d, mask_d, qk_scale, D, BLOCK_SIZE, KVH, BLOCK_N, IEEE, True)
            n0 += BLOCK_N
    out = acc / l_i[:, None]
    tl.store(o_ptr + (q_start + offs_m)[:, None] * (H * D) + head * D + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def tile_order(context_lens: list[int], query_start_loc: list[int], block_m: int) -> tuple[list[int], list[int]]:
    """The query tiles of ``block_m`` rows of a step's sequences, those with the most keys first (the last tiles of
    the longest contexts, so the short ones fill the tail): each one's sequence and first new row."""
    qsl = query_start_loc
    tiles = sorted(((context_lens[i] - (qsl[i + 1] - qsl[i]) + m0, i, m0)
                    for i in range(len(context_lens)) for m0 in range(0, qsl[i + 1] - qsl[i], block_m)),
                   reverse=True)
    return [i for _, i, _ in tiles], [m0 for _, _, m0 in tiles]


def tile_key(block_m: int) -> tuple[str, int]:
    """Where a step's metadata keeps its tiles of ``block_m`` rows (``AttentionMetadata.derived``): (their count,
    each one's sequence, each one's first row), the last two on the device. A captured step
    (engine/worker/step_graphs.py) puts static buffers there, padded with tiles of an empty sequence."""
    return "prefill_tiles", block_m


def _tile_order(meta: AttentionMetadata, block_m: int, dev: torch.device):
    """``tile_order`` on the device, made once per step for all its layers, in one copy that does not wait for the
    stream."""
    key = tile_key(block_m)  # a step's metadata serves one device
    if key not in meta.derived:
        seqs, rows = tile_order(meta.context_lens, meta.query_start_loc, block_m)
        both = device_ints([seqs, rows], torch.int32, dev)
        meta.derived[key] = (len(seqs), both[0], both[1])
    return meta.derived[key]


def prefill_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                      block_m: int = PREFILL_TILES["block_m"], block_n: int = PREFILL_TILES["block_n"],
                      num_warps: int = PREFILL_TILES["num_warps"], num_stages: int = PREFILL_TILES["num_stages"],
                      counted: bool | None = None):
    """``paged_attention_ref``'s result for a batch with prefill or chunked-prefill sequences (decode rows among
    them too), in ``block_m`` query rows by ``block_n`` keys per tile. ``counted``: the key loops as counted
    loops (default: on a GPU; False runs the interpreter's while loops there too, for a comparison)."""
    t, h, d = q.shape
    kvh, bs = k_cache.shape[2], k_cache.shape[1]
    n_tiles, tile_seq, tile_m0 = _tile_order(meta, block_m, q.device)
    out = torch.empty((t, h, d), device=q.device, dtype=q.dtype)
    args = (q, k_cache, v_cache, out, meta.block_tables, meta.context_lens_t, meta.query_start_loc_t, tile_seq,
            tile_m0, q.stride(0), q.stride(1), meta.block_tables.stride(0), scale * LOG2E, h // kvh, d, bs, kvh, h)
    common = dict(D_PAD=max(16, triton.next_power_of_2(d)), IEEE=q.dtype == torch.float32,
                  COUNTED=not interpreted() if counted is None else counted)
    try:
        _prefill_kernel[(n_tiles, h)](*args, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
                                         num_stages=num_stages, **common)
    except triton.runtime.errors.OutOfResources:
        # a GPU with less shared memory than these tiles need (the defaults are sized for Hopper's): the keys per
        # tile halved, then the stages cut, until they fit
        if block_n <= 16 and num_stages <= 1:
            raise
        return prefill_attention(q, k_cache, v_cache, meta, scale, block_m, max(16, block_n // 2), num_warps,
                                 max(1, num_stages - 1) if block_n <= 16 else num_stages, counted)
    return out
