"""Triton mixture-of-experts; same signature as ``kernels.moe.moe_ref``. Two paths:

- few routed (token, slot) pairs (decode): a fused routing kernel (softmax, top-k,
  renormalization) and two matrix-vector kernels that read each pair's expert from a device
  tensor (or all of it in one kernel that routes for itself and sums by atomics). Nothing goes
  back to the host, so the step can be captured in a CUDA graph, and each routed expert's
  weights are read once per pair: the bytes a decode step must move.
- many pairs (prefill): routing is the reference's; the pairs are sorted by expert and padded
  to whole BLOCK_M tiles, so every program of the grouped matmul multiplies rows of one
  expert only (the grouping reads the counts on the host).

``norm_moe_triton`` is the whole block after attention (residual add, RMSNorm, router, routing,
experts): for a decode batch the first four are one launch.
"""
from __future__ import annotations

import functools
import inspect

import torch
import triton
import triton.language as tl

from kernels.activation import silu_and_mul_ref
from kernels.activation_triton import silu_mul
from kernels.moe import moe_route_ref
from kernels.counters import ArrivalCounters, fresh_counters
from kernels.linear_triton import _add_rms_rstd, _gemv_rows
from kernels.pdl import launch_options, pdl_enter


@triton.jit
def _grouped_matmul_kernel(
    a_ptr, w_ptr, c_ptr, pairs_ptr, tile_expert_ptr, weight_ptr, num_pairs, N, K, A_DIV,
    stride_am, stride_we, stride_wn, stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    IEEE: tl.constexpr,
):
    """C[pair] = A[pair // A_DIV] @ W[expert].T (times the pair's routing weight), for one tile of pairs."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
    pair = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # padding entries hold num_pairs
    mask_m = pair < num_pairs
    a_row = (pair // A_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k0 = 0
    while k0 < K:  # a while loop: the CPU interpreter's range() wants Python scalars
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(a_ptr + a_row[:, None] * stride_am + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0)
        w = tl.load(w_ptr + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None],
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)  # (BLOCK_K, BLOCK_N)
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
        k0 += BLOCK_K
    if MUL_WEIGHT:
        acc = acc * tl.load(weight_ptr + pair, mask=mask_m, other=0.0)[:, None]
    tl.store(c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def _group_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs (token * k + slot) sorted by expert and padded per expert to whole tiles; each tile's expert."""
    flat = ids.reshape(-1)
    num_pairs = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    pairs, tile_expert, start = [], [], 0
    order_list = order.tolist()
    for e, c in enumerate(counts):
        if c == 0:
            continue
        tiles = -(-c // block_m)
        pairs.extend(order_list[start : start + c] + [num_pairs] * (tiles * block_m - c))
        tile_expert.extend([e] * tiles)
        start += c
    dev = ids.device
    return (torch.tensor(pairs, dtype=torch.int32, device=dev), torch.tensor(tile_expert, dtype=torch.int32, device=dev))


def _grouped_matmul(a, w, pairs, tile_expert, num_pairs, a_div, weights, block_m, block_n, block_k):
    n, k = w.shape[1], w.shape[2]
    assert w.is_contiguous() and a.stride(1) == 1
    out = torch.empty((num_pairs, n), device=a.device, dtype=a.dtype)
    grid = (tile_expert.numel(), triton.cdiv(n, block_n))
    _grouped_matmul_kernel[grid](
        a, w, out, pairs, tile_expert, weights if weights is not None else out, num_pairs, n, k, a_div,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, MUL_WEIGHT=weights is not None,
        IEEE=a.dtype == torch.float32,
    )
    return out


@triton.jit
def _route_probs(logits_ptr, t, E, BLOCK_E: tl.constexpr):
    """Token t's softmax over the experts in float32 (-1 past the last expert), and the experts' indices. The
    logits are read from L2 (``.cg``): another program of the same launch may have just written them."""
    offs = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + t * E + offs, mask=offs < E, other=float("-inf"), cache_modifier=".cg").to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    return tl.where(offs < E, p / tl.sum(p, axis=0), -1.0), offs


@triton.jit
def _route_row(logits_ptr, w_ptr, ids_ptr, t, E, TOP_K: tl.constexpr, RENORM: tl.constexpr, BLOCK_E: tl.constexpr,
               K_PAD: tl.constexpr):
    """Token t: softmax over the experts in float32 (``_route_probs``), the top k (lowest index on ties),
    optionally renormalized."""
    p, offs = _route_probs(logits_ptr, t, E, BLOCK_E)
    offs_k = tl.arange(0, K_PAD)
    top_w = tl.zeros([K_PAD], tl.float32)
    top_i = tl.zeros([K_PAD], tl.int32)
    for j in tl.static_range(TOP_K):  # the k choices stay in registers: one store of each at the end
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, offs, BLOCK_E), axis=0)
        top_w = tl.where(offs_k == j, best, top_w)
        top_i = tl.where(offs_k == j, idx, top_i)
        p = tl.where(offs == idx, -1.0, p)
    if RENORM:
        top_w = top_w / tl.sum(top_w, axis=0)
    tl.store(w_ptr + t * TOP_K + offs_k, top_w, mask=offs_k < TOP_K)
    tl.store(ids_ptr + t * TOP_K + offs_k, top_i, mask=offs_k < TOP_K)


@triton.jit
def _route_ranks(logits_ptr, t, E, BLOCK_E: tl.constexpr):
    """Token t's probabilities (``_route_probs``), the experts' indices and every expert's rank: the number of
    experts ahead of it (a higher probability, or the same and a lower index)."""
    p, offs = _route_probs(logits_ptr, t, E, BLOCK_E)
    ahead = (p[None, :] > p[:, None]) | ((p[None, :] == p[:, None]) & (offs[None, :] < offs[:, None]))
    return p, offs, tl.sum(ahead.to(tl.int32), axis=1)


@triton.jit
def _route_kernel(logits_ptr, w_ptr, ids_ptr, E, TOP_K: tl.constexpr, RENORM: tl.constexpr, BLOCK_E: tl.constexpr,
                  K_PAD: tl.constexpr, RANK: tl.constexpr = 0, PDL: tl.constexpr = 0):
    """One program per token: ``_route_row`` (k serial reductions), or with RANK the same choice from every
    expert's rank at once (``_route_ranks``)."""
    t = tl.program_id(0)
    pdl_enter(PDL)
    if RANK:
        p, offs, rank = _route_ranks(logits_ptr, t, E, BLOCK_E)
        slots = tl.arange(0, K_PAD)
        hit = rank[None, :] == slots[:, None]  # (K_PAD, BLOCK_E): slot j holds the expert of rank j
        top_i = tl.sum(tl.where(hit, offs[None, :], 0), axis=1)
        top_w = tl.sum(tl.where(hit, p[None, :], 0.0), axis=1)
        if RENORM:
            top_w = top_w / tl.sum(tl.where(slots < TOP_K, top_w, 0.0), axis=0)
        tl.store(w_ptr + t * TOP_K + slots, top_w, mask=slots < TOP_K)
        tl.store(ids_ptr + t * TOP_K + slots, top_i, mask=slots < TOP_K)
    else:
        _route_row(logits_ptr, w_ptr, ids_ptr, t, E, TOP_K, RENORM, BLOCK_E, K_PAD)


@triton.jit
def _norm_router_kernel(x_ptr, r_ptr, nw_ptr, w_ptr, logits_ptr, sum_ptr, h_ptr, rw_ptr, ids_ptr, cnt_ptr,
                        M, E, eps, K: tl.constexpr, TOP_K: tl.constexpr, RENORM: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        BLOCK_E: tl.constexpr, K_PAD: tl.constexpr, ROUTE: tl.constexpr, PDL: tl.constexpr = 0):
    """The MoE block's first step in one launch: the router logits of h = rms_norm(x + residual) for BLOCK_N
    experts per program (program 0 also writes x + residual and h for the expert kernels), and with ROUTE
    routing by the last program to finish, which alone sees every expert's logit (and resets the counter)."""
    pid = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < E
    rk0 = tl.arange(0, BLOCK_K)
    w_first = tl.load(w_ptr + rn[:, None] * K + rk0[None, :], mask=n_mask[:, None] & (rk0 < K)[None, :], other=0.0)
    pdl_enter(PDL)
    if K <= BLOCK_K:  # the whole row in one chunk: x + residual read once, normed in registers
        mk = m_mask[:, None] & (rk0 < K)[None, :]
        s = tl.load(r_ptr + rm[:, None] * K + rk0[None, :], mask=mk, other=0.0) + tl.load(
            x_ptr + rm[:, None] * K + rk0[None, :], mask=mk, other=0.0)
        sf = s.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(sf * sf, axis=1) / K + eps)
        h = tl.load(nw_ptr + rk0, mask=rk0 < K, other=0.0)[None, :] * (sf * rstd[:, None]).to(s.dtype)
        if pid == 0:
            tl.store(sum_ptr + rm[:, None] * K + rk0[None, :], s, mask=mk)
            tl.store(h_ptr + rm[:, None] * K + rk0[None, :], h, mask=mk)
        acc = tl.sum(h.to(tl.float32)[:, None, :] * w_first.to(tl.float32)[None, :, :], axis=2)
    else:
        rstd = _add_rms_rstd(x_ptr, r_ptr, sum_ptr, rm, m_mask, K, K, K, eps, pid == 0, K, BLOCK_M, BLOCK_K)
        if pid == 0:  # h, the experts' input, in the reference's rounding (kernels.norm)
            for k0 in range(0, K, BLOCK_K):
                rk = k0 + tl.arange(0, BLOCK_K)
                mk = m_mask[:, None] & (rk < K)[None, :]
                s = tl.load(r_ptr + rm[:, None] * K + rk[None, :], mask=mk, other=0.0) + tl.load(
                    x_ptr + rm[:, None] * K + rk[None, :], mask=mk, other=0.0)
                h = tl.load(nw_ptr + rk, mask=rk < K, other=0.0)[None, :] * (
                    s.to(tl.float32) * rstd[:, None]).to(s.dtype)
                tl.store(h_ptr + rm[:, None] * K + rk[None, :], h, mask=mk)
        acc = _gemv_rows(w_ptr, w_first, rn, n_mask, K, x_ptr, r_ptr, nw_ptr, rm, m_mask, K, K, rstd, K, 2, BLOCK_M,
                         BLOCK_N, BLOCK_K, "")
    tl.store(logits_ptr + rm[:, None] * E + rn[None, :], acc.to(logits_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])
    if ROUTE:
        # the last program to get here routes: its acquire sees every program's logits (released after a barrier)
        tl.debug_barrier()
        if tl.atomic_add(cnt_ptr, 1) == tl.num_programs(0) - 1:
            t = 0
            while t < M:  # a while loop: the CPU interpreter's range() wants Python scalars
                _route_row(logits_ptr, rw_ptr, ids_ptr, t, E, TOP_K, RENORM, BLOCK_E, K_PAD)
                t += 1
            tl.atomic_xchg(cnt_ptr, 0)


@triton.jit
def _pair_gate_up_kernel(x_ptr, w_ptr, ids_ptr, out_ptr, cnt_ptr, n_cnt, N, TOP_K, stride_we, stride_wn,
                         K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ZERO_CNT: tl.constexpr,
                         EVICT: tl.constexpr = "", ACT: tl.constexpr = 0, PDL: tl.constexpr = 0):
    """out[pair, n] = x[pair // TOP_K] . w13[expert(pair), n] for one block of n. With ACT, N is the intermediate
    size and the block's gate rows n and up rows N + n are read together: out[pair, n] = silu(gate) * up, in the
    reference's rounding (kernels.activation). With ZERO_CNT the programs also zero the n_cnt arrival counters
    the down kernel after them counts on. EVICT: the weights' L2 eviction policy ("evict_first": streamed
    through once, so they do not push out of L2 what other kernels read again)."""
    pair = tl.program_id(0)
    pdl_enter(PDL)  # the expert comes from the routing kernel: no weight can be requested before
    if ZERO_CNT:
        programs = tl.num_programs(0) * tl.num_programs(1)
        i = pair * tl.num_programs(1) + tl.program_id(1)
        while i < n_cnt:
            tl.store(cnt_ptr + i, 0)
            i += programs
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    e = tl.load(ids_ptr + pair).to(tl.int64)
    row = x_ptr + (pair // TOP_K) * K
    acc = tl.zeros([BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_N], tl.float32)
    w_rows = w_ptr + e * stride_we + offs_n[:, None] * stride_wn
    for k0 in range(0, K, BLOCK_K):  # K is known when compiling: a counted loop, its loads pipelined
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(row + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        mask = mask_n[:, None] & mask_k[None, :]
        w = tl.load(w_rows + offs_k[None, :], mask=mask, other=0.0, eviction_policy=EVICT)
        acc += tl.sum(w.to(tl.float32) * a[None, :], axis=1)
        if ACT:
            w = tl.load(w_rows + N * stride_wn + offs_k[None, :], mask=mask, other=0.0, eviction_policy=EVICT)
            up += tl.sum(w.to(tl.float32) * a[None, :], axis=1)
    dtype = out_ptr.dtype.element_ty
    if ACT:
        acc = silu_mul(acc.to(dtype), up.to(dtype))
    tl.store(out_ptr + pair * N + offs_n, acc.to(dtype), mask=mask_n)


@triton.jit
def _act_dot(acc, w, gu_ptr, pair, k0, I, BLOCK_K: tl.constexpr, ACT: tl.constexpr = 0):
    """acc + w . (silu(gate) * up)[pair, k0 : k0 + BLOCK_K], in the reference's rounding (kernels.activation);
    with ACT gu holds the activation (I per pair), else gate and up (2I per pair)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask_k = offs_k < I
    if ACT:
        return acc + tl.sum(w.to(tl.float32) * tl.load(gu_ptr + pair * I + offs_k, mask=mask_k,
                                                       other=0.0).to(tl.float32)[None, :], axis=1)
    g = tl.load(gu_ptr + pair * 2 * I + offs_k, mask=mask_k, other=0.0)
    u = tl.load(gu_ptr + pair * 2 * I + I + offs_k, mask=mask_k, other=0.0)
    act = silu_mul(g, u).to(tl.float32)
    return acc + tl.sum(w.to(tl.float32) * act[None, :], axis=1)


@triton.jit
def _pair_down_kernel(gu_ptr, w_ptr, ids_ptr, rw_ptr, out_ptr, N, stride_we, stride_wn, I: tl.constexpr,
                      TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVICT: tl.constexpr = "",
                      ACT: tl.constexpr = 0, PDL: tl.constexpr = 0):
    """out[t, n] = sum_j weight[t, j] * (silu(gate) * up)[t, j] . w2[expert(t, j), n]: the activation (with ACT
    already applied by the gate/up kernel), the routing weights and the sum over the k experts, in one pass per
    block of n."""
    t = tl.program_id(0)
    pdl_enter(PDL)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    total = tl.zeros([BLOCK_N], tl.float32)
    for j in tl.static_range(TOP_K):
        pair = t * TOP_K + j
        e = tl.load(ids_ptr + pair).to(tl.int64)
        acc = tl.zeros([BLOCK_N], tl.float32)
        for k0 in range(0, I, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(w_ptr + e * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :],
                        mask=mask_n[:, None] & (offs_k < I)[None, :], other=0.0, eviction_policy=EVICT)
            acc = _act_dot(acc, w, gu_ptr, pair, k0, I, BLOCK_K, ACT)
        total += acc * tl.load(rw_ptr + pair)
    tl.store(out_ptr + t * N + offs_n, total.to(out_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _pair_down_split_kernel(gu_ptr, w_ptr, ids_ptr, rw_ptr, part_ptr, out_ptr, cnt_ptr, N, stride_we, stride_wn,
                            I: tl.constexpr, TOP_K: tl.constexpr, SUM: tl.constexpr, EARLY: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVICT: tl.constexpr = "",
                            ACT: tl.constexpr = 0, PDL: tl.constexpr = 0):
    """part[pair, n] = weight[pair] * (silu(gate) * up)[pair] . w2[expert(pair), n] (ACT: gu holds the
    activation, as ``_pair_down_kernel``): one pair per program row,
    so k times the programs of the fused kernel. The k rows of a token are summed afterwards, or with SUM by
    the last of the token's k programs for this block of n (in slot order, as ``_sum_pairs_kernel``), counted on
    cnt, which the gate/up kernel before zeroed. With EARLY the expert and the first chunk of its weights are
    requested before the wait: the routing kernel two launches back has finished, as the gate/up kernel
    between lets this one be scheduled only after its own wait (``pdl`` 1)."""
    pair = tl.program_id(0)
    if not EARLY:
        pdl_enter(PDL)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    e = tl.load(ids_ptr + pair, cache_modifier=".cg").to(tl.int64)  # from L2: written by an earlier kernel
    w_row = w_ptr + e * stride_we + offs_n[:, None] * stride_wn
    offs_k = tl.arange(0, BLOCK_K)
    w = tl.load(w_row + offs_k[None, :], mask=mask_n[:, None] & (offs_k < I)[None, :], other=0.0,
                eviction_policy=EVICT)
    if EARLY:
        pdl_enter(PDL)
    acc = _act_dot(tl.zeros([BLOCK_N], tl.float32), w, gu_ptr, pair, 0, I, BLOCK_K, ACT)
    for k0 in range(BLOCK_K, I, BLOCK_K):  # I is known when compiling: a counted loop, its loads pipelined
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_row + offs_k[None, :], mask=mask_n[:, None] & (offs_k < I)[None, :], other=0.0,
                    eviction_policy=EVICT)
        acc = _act_dot(acc, w, gu_ptr, pair, k0, I, BLOCK_K, ACT)
    tl.store(part_ptr + pair * N + offs_n, acc * tl.load(rw_ptr + pair), mask=mask_n)
    if SUM:
        t = pair // TOP_K
        cnt = cnt_ptr + t * tl.num_programs(1) + tl.program_id(1)
        tl.debug_barrier()
        if tl.atomic_add(cnt, 1) == TOP_K - 1:
            total = tl.zeros([BLOCK_N], tl.float32)
            for j in tl.static_range(TOP_K):
                total += tl.load(part_ptr + (t * TOP_K + j) * N + offs_n, mask=mask_n, other=0.0,
                                 cache_modifier=".cg")
            tl.store(out_ptr + t * N + offs_n, total.to(out_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _sum_pairs_kernel(part_ptr, out_ptr, N, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr = 0):
    """out[t, n] = sum over the token's k pairs of part[t * k + j, n] (float32), cast to out's dtype."""
    t = tl.program_id(0)
    pdl_enter(PDL)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < N
    acc = tl.zeros([BLOCK_N], tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(part_ptr + (t * TOP_K + j) * N + offs, mask=mask, other=0.0)
    tl.store(out_ptr + t * N + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _route_slot(logits_ptr, t, j, E, TOP_K: tl.constexpr, RENORM: tl.constexpr, BLOCK_E: tl.constexpr):
    """Token t's expert in slot j and its weight, as ``_route_row`` chooses them (softmax in float32, the top k
    with the lowest index first on ties, optionally renormalized), without a serial loop: every expert's rank
    is the number of experts ahead of it."""
    p, offs, rank = _route_ranks(logits_ptr, t, E, BLOCK_E)
    e = tl.sum(tl.where(rank == j, offs, 0), axis=0)
    w = tl.sum(tl.where(rank == j, p, 0.0), axis=0)
    if RENORM:
        w = w / tl.sum(tl.where(rank < TOP_K, p, 0.0), axis=0)
    return e, w


@triton.jit
def _fused_experts_kernel(x_ptr, logits_ptr, w13_ptr, w2_ptr, acc_ptr, out_ptr, cnt_ptr, M, E,
                          stride_13e, stride_13n, stride_2e, stride_2n, H: tl.constexpr, I: tl.constexpr,
                          TOP_K: tl.constexpr, RENORM: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr,
                          C_PAD: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                          PDL: tl.constexpr = 0):
    """The decode path's whole MoE after the router in one launch: program (pair, c) routes the pair's token
    (``_route_slot``), computes CHUNK rows of its expert's gate and up projections, their activation times the
    routing weight, and adds that chunk's share of the down projection into the float32 sum acc (atomics). The
    last program to finish casts the sum to out and zeroes acc and its counter for the next call."""
    pair = tl.program_id(0)
    t = pair // TOP_K
    offs_c = tl.arange(0, C_PAD)
    rows = tl.program_id(1) * CHUNK + offs_c
    mask_c = (offs_c < CHUNK) & (rows < I)
    pdl_enter(PDL)  # the logits come from the router before: no weight can be requested before
    e, weight = _route_slot(logits_ptr, t, pair % TOP_K, E, TOP_K, RENORM, BLOCK_E)
    w_gate = w13_ptr + e.to(tl.int64) * stride_13e + rows[:, None] * stride_13n
    w_up = w_gate + I * stride_13n
    gate = tl.zeros([C_PAD], tl.float32)
    up = tl.zeros([C_PAD], tl.float32)
    for k0 in range(0, H, BLOCK_K):  # H is known when compiling: a counted loop, its loads pipelined
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = mask_c[:, None] & (offs_k < H)[None, :]
        a = tl.load(x_ptr + t * H + offs_k, mask=offs_k < H, other=0.0).to(tl.float32)[None, :]
        gate += tl.sum(tl.load(w_gate + offs_k[None, :], mask=mask, other=0.0).to(tl.float32) * a, axis=1)
        up += tl.sum(tl.load(w_up + offs_k[None, :], mask=mask, other=0.0).to(tl.float32) * a, axis=1)
    # the activation in the reference's rounding (gate and up in the activations' dtype, kernels.activation)
    dtype = out_ptr.dtype.element_ty
    act = silu_mul(gate.to(dtype), up.to(dtype)).to(tl.float32)
    act = tl.where(mask_c, act, 0.0) * weight
    w_down = w2_ptr + e.to(tl.int64) * stride_2e + rows[None, :]
    for n0 in range(0, H, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        w = tl.load(w_down + offs_n[:, None] * stride_2n, mask=(offs_n < H)[:, None] & mask_c[None, :], other=0.0)
        tl.atomic_add(acc_ptr + t * H + offs_n, tl.sum(w.to(tl.float32) * act[None, :], axis=1),
                      mask=offs_n < H, sem="relaxed")
    # the last program to get here finishes: its acquire sees every program's sums (released after a barrier)
    tl.debug_barrier()
    if tl.atomic_add(cnt_ptr, 1) == tl.num_programs(0) * tl.num_programs(1) - 1:
        n0 = 0
        while n0 < M * H:  # a while loop: the CPU interpreter's range() wants Python scalars
            offs = n0 + tl.arange(0, BLOCK_N)
            mask = offs < M * H
            tl.store(out_ptr + offs, tl.load(acc_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg").to(dtype),
                     mask=mask)
            tl.store(acc_ptr + offs, tl.zeros([BLOCK_N], tl.float32), mask=mask)
            n0 += BLOCK_N
        tl.atomic_xchg(cnt_ptr, 0)


def moe_route_triton(router_logits: torch.Tensor, top_k: int, renormalize: bool, pdl: int = 0, rank: int = 0
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``kernels.moe.moe_route_ref`` (ids as int32): weights (T, k) float32, ids (T, k).
    ``rank``: the top k from every expert's rank at once (four warps) instead of k serial reductions."""
    t, e = router_logits.shape
    logits = router_logits.contiguous()
    weights = torch.empty((t, top_k), device=logits.device, dtype=torch.float32)
    ids = torch.empty((t, top_k), device=logits.device, dtype=torch.int32)
    if t:
        # serial: one warp for up to 256 experts, each of the k reductions within the warp
        _route_kernel[(t,)](logits, weights, ids, e, TOP_K=top_k, RENORM=renormalize,
                            BLOCK_E=triton.next_power_of_2(e), K_PAD=triton.next_power_of_2(top_k), RANK=bool(rank),
                            num_warps=4 if rank or e > 256 else 1,
                            **launch_options(pdl, logits))
    return weights, ids


def _pair_experts(x, weights, ids, w13, w2, top_k, block_n, block_k, down_block_n, num_warps, split_down, pdl,
                  down_early=0, down_block_k=None, num_stages=1, evict=0, act=0):
    """The routed experts of the decode path: per (token, slot) pair matrix-vector products; ``evict``: their
    weights read with the L2 "evict first" policy; ``act``: the activation applied by the gate/up kernel."""
    down_block_k = down_block_k or block_k
    t, h = x.shape
    i = w2.shape[2]
    assert w13.is_contiguous() and w2.is_contiguous()
    x = x.contiguous()
    opts = launch_options(pdl, x)
    evict = "evict_first" if evict else ""
    gate_up = torch.empty((t * top_k, i if act else 2 * i), device=x.device, dtype=x.dtype)
    n_blocks = triton.cdiv(h, down_block_n)
    # the down kernel's arrival counters: this call's own (the gate/up kernel zeroes them), so launches on other
    # streams (a variant warming up while the engine serves) never share one
    cnt = torch.empty(t * n_blocks, device=x.device, dtype=torch.int32) if split_down == 2 else None
    n = gate_up.shape[1]
    _pair_gate_up_kernel[(t * top_k, triton.cdiv(n, block_n))](
        x, w13, ids, gate_up, cnt if cnt is not None else ids, 0 if cnt is None else cnt.numel(), n, top_k,
        w13.stride(0), w13.stride(1), K=h, BLOCK_N=block_n, BLOCK_K=block_k, ZERO_CNT=cnt is not None, EVICT=evict,
        ACT=bool(act),
        num_warps=num_warps, num_stages=num_stages, **(launch_options(1, x) if down_early and pdl else opts))
    out = torch.empty_like(x)
    if split_down:
        part = torch.empty((t * top_k, h), device=x.device, dtype=torch.float32)
        _pair_down_split_kernel[(t * top_k, n_blocks)](
            gate_up, w2, ids, weights, part, out, cnt if cnt is not None else ids, h, w2.stride(0), w2.stride(1),
            I=i, TOP_K=top_k, SUM=cnt is not None, EARLY=bool(down_early), BLOCK_N=down_block_n,
            BLOCK_K=down_block_k, EVICT=evict, ACT=bool(act),
            num_warps=num_warps, num_stages=num_stages, **opts)
        if cnt is None:
            _sum_pairs_kernel[(t, triton.cdiv(h, 1024))](part, out, h, TOP_K=top_k, BLOCK_N=1024, **opts)
        return out
    _pair_down_kernel[(t, triton.cdiv(h, down_block_n))](
        gate_up, w2, ids, weights, out, h, w2.stride(0), w2.stride(1), I=i,
        TOP_K=top_k, BLOCK_N=down_block_n, BLOCK_K=down_block_k, EVICT=evict, ACT=bool(act), num_warps=num_warps,
        num_stages=num_stages, **opts)
    return out


def _fused_experts(x, router_logits, w13, w2, top_k, renormalize, chunk, block_k, block_n, num_warps, num_stages,
                    pdl, scratch=None):
    """The decode path in one launch (``_fused_experts_kernel``); ``scratch(n, device, dtype)``: zeroed buffers
    the kernel leaves zeroed (the float32 sum and the arrival counter; default: fresh per call)."""
    t, h = x.shape
    e, i = router_logits.shape[1], w2.shape[2]
    assert w13.is_contiguous() and w2.is_contiguous()
    x, logits = x.contiguous(), router_logits.contiguous()
    scratch = scratch or fresh_counters
    acc = scratch(t * h, x.device, torch.float32)
    cnt = scratch(1, x.device, torch.int32)
    out = torch.empty_like(x)
    _fused_experts_kernel[(t * top_k, triton.cdiv(i, chunk))](
        x, logits, w13, w2, acc, out, cnt, t, e, w13.stride(0), w13.stride(1), w2.stride(0), w2.stride(1), H=h, I=i,
        TOP_K=top_k, RENORM=renormalize, BLOCK_E=triton.next_power_of_2(e), CHUNK=chunk,
        C_PAD=triton.next_power_of_2(chunk), BLOCK_K=block_k, BLOCK_N=block_n, num_warps=num_warps,
        num_stages=num_stages, **launch_options(pdl, x))
    return out


def moe_triton(
    x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int, renormalize: bool,
    block_m: int = 16, block_n: int = 32, block_k: int = 32,
    max_decode_pairs: int = 64, decode_block_n: int = 8, decode_block_k: int = 256, decode_down_block_n: int = 8,
    decode_warps: int = 4, decode_split_down: int = 1, decode_down_early: int = 0, decode_down_block_k: int = 0,
    decode_stages: int = 1, decode_chunk: int = 32, decode_route_rank: int = 0, decode_evict: int = 0,
    decode_act: int = 0, pdl: int = 0,
    scratch=None,
) -> torch.Tensor:
    """x: (T, H); router_logits: (T, E); w13: (E, 2I, H) holding [gate | up]; w2: (E, H, I). Returns (T, H).

    Up to ``max_decode_pairs`` routed pairs (any number while a CUDA graph is captured) take the device-only
    decode path (``decode_*`` parameters; ``decode_split_down``: 0, one down-projection program row per token
    looping over its k experts; 1, one per pair, summed by another launch; 2, one per pair, summed by the last
    of a token's k programs; 3, routing, gate/up, down and the sum in one launch, ``decode_chunk`` rows of the
    intermediate per program, ``decode_block_k`` and ``decode_down_block_n`` its tiles (slower than 2 at batch 1
    on an H200: bench/RESULTS.md); ``decode_down_early``: 1, the split down kernel requests its weights before
    it waits for the gate/up kernel, which then waits before letting it be scheduled); more take the grouped
    matmul (``block_*``). ``decode_down_block_k``: the down kernel's chunk of the intermediate (0: as
    ``decode_block_k``); ``decode_stages``: how many chunks ahead their loops request (1: none);
    ``decode_route_rank``: the routing kernel's top k from every expert's rank at once (four warps) instead of k
    serial reductions (one warp; measured slower at batch 1 on an H200: bench/RESULTS.md); ``decode_evict``: 1,
    the experts' weights read with the L2 "evict first" policy (streamed through once, so they do not push out
    of L2 what other kernels read again); ``decode_act``: 1, each gate/up program reads matching gate and up
    rows and writes their activation, so the down programs read half as much and compute no activation.
    ``pdl``: the decode path's kernels with programmatic dependent launch (kernels/pdl.py); ``scratch(n, device,
    dtype)``: the one-launch form's zeroed sum and counter (default: fresh per call; ``make_moe`` keeps them).
    """
    t, h = x.shape
    assert w13.shape[2] == h and w2.shape[1] == h and w13.shape[1] == 2 * w2.shape[2]
    if t == 0:
        return torch.empty_like(x)
    # the grouped path reads counts on the host, which a CUDA graph capture cannot: capture the decode path
    if t * top_k <= max_decode_pairs or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        if decode_split_down == 3:
            return _fused_experts(x, router_logits, w13, w2, top_k, renormalize, decode_chunk, decode_block_k,
                                  decode_down_block_n, decode_warps, decode_stages, pdl, scratch)
        weights, ids = moe_route_triton(router_logits, top_k, renormalize, pdl, decode_route_rank)
        return _pair_experts(x, weights, ids, w13, w2, top_k, decode_block_n, decode_block_k, decode_down_block_n,
                             decode_warps, decode_split_down, pdl, decode_down_early, decode_down_block_k,
                             decode_stages, decode_evict, decode_act)
    weights, ids = moe_route_ref(router_logits, top_k, renormalize)
    pairs, tile_expert = _group_by_expert(ids, w13.shape[0], block_m)
    num_pairs = t * top_k
    x = x.contiguous()
    gate_up = _grouped_matmul(x, w13, pairs, tile_expert, num_pairs, top_k, None, block_m, block_n, block_k)
    act = silu_and_mul_ref(gate_up)  # (T * k, I)
    down = _grouped_matmul(act, w2, pairs, tile_expert, num_pairs, 1, weights.to(x.dtype).reshape(-1).contiguous(),
                           block_m, block_n, block_k)
    return down.view(t, top_k, h).sum(dim=1)


# moe_triton's tunable parameters and their defaults
_MOE_PARAMS = {k: p.default for k, p in inspect.signature(moe_triton).parameters.items()
               if p.default is not inspect.Parameter.empty and k not in ("pdl", "scratch")}


# the choices of moe_triton's switch-like parameters; every other one is a positive tile size or count
_MOE_CHOICES = {"decode_split_down": (0, 1, 2, 3), "decode_down_early": (0, 1), "decode_route_rank": (0, 1),
                "decode_evict": (0, 1), "decode_act": (0, 1), "pdl": (0, 1, 2), "route_by_last": (0, 1)}
_POW2 = ("block_m", "block_n", "block_k", "decode_block_n", "decode_block_k", "decode_down_block_n", "decode_warps",
         "decode_down_block_k", "router_block_n", "router_block_k", "router_warps")


def check_moe_params(params: dict, known: dict) -> None:
    """A variant's moe (or norm_moe) parameters checked when it is built: ``ValueError`` names an unknown one, one
    out of its range, or a combination the kernels do not have (the activation in gate/up with the one-launch
    experts); ``known``: the accepted names and their defaults."""
    unknown = set(params) - set(known)
    if unknown:
        raise ValueError(f"unknown moe parameters {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}")
    p = {**known, **params}
    for k, v in params.items():
        if not isinstance(v, int) or isinstance(v, bool):
            raise ValueError(f"moe parameter {k} must be an integer, got {v!r}")
        if k in _MOE_CHOICES:
            if v not in _MOE_CHOICES[k]:
                raise ValueError(f"moe parameter {k} must be one of {', '.join(map(str, _MOE_CHOICES[k]))}, got {v}")
        elif v < (0 if k == "decode_down_block_k" else 1):
            raise ValueError(f"moe parameter {k} must be positive, got {v}")
        if k in _POW2 and v & (v - 1):
            raise ValueError(f"moe parameter {k} must be a power of two, got {v}")
    if p["decode_act"] and p["decode_split_down"] == 3:
        raise ValueError("moe decode_act needs decode_split_down 0, 1 or 2 (the one-launch experts apply the "
                         "activation themselves)")


def make_moe(**params):
    """The moe callable for a variant: ``moe_triton`` with its parameters (checked here) and this table's own
    zeroed sum and counter for the one-launch form."""
    check_moe_params(params, {**_MOE_PARAMS, "pdl": 0})
    return functools.partial(moe_triton, **params, scratch=ArrivalCounters())


def norm_moe_triton(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_weight: torch.Tensor,
    w13: torch.Tensor, w2: torch.Tensor, top_k: int, renormalize: bool, *, router_block_n: int = 2,
    router_block_k: int = 512, router_warps: int = 4, route_by_last: int = 1, pdl: int = 0, counters=None,
    **moe_params,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``kernels.moe.norm_moe_ref``. A decode batch (at most 4 tokens and ``max_decode_pairs``
    pairs) takes one launch for the residual add, RMSNorm and router (``router_*`` tiles) and, with
    ``route_by_last``, routing by its last program (else the routing kernel after it), then the decode path's
    expert kernels (with ``decode_split_down`` 3 the experts' one launch, which routes for itself); larger
    batches the Triton norm, torch's router and ``moe_triton``. ``moe_params``: ``moe_triton``'s parameters;
    ``pdl``: programmatic dependent launch (kernels/pdl.py); ``counters(n, device, dtype)``: the routing's
    arrival counter, or the one-launch experts' sum and counter (default: zeroed per call; ``make_norm_moe``
    keeps them)."""
    from kernels.norm_triton import fused_add_rms_norm_triton

    unknown = set(moe_params) - set(_MOE_PARAMS)
    if unknown:
        raise TypeError(f"norm_moe_triton: unknown parameters {', '.join(sorted(unknown))}")
    t, hidden = x.shape
    e = gate_weight.shape[0]
    assert residual.shape == x.shape and norm_weight.shape == (hidden,) and gate_weight.shape == (e, hidden)
    p = {**_MOE_PARAMS, **moe_params}
    if not 0 < t <= 4 or t * top_k > p["max_decode_pairs"]:
        h, summed = fused_add_rms_norm_triton(x, residual, norm_weight, eps, pdl=pdl)
        return moe_triton(h, torch.nn.functional.linear(h, gate_weight), w13, w2, top_k, renormalize, pdl=pdl,
                          **moe_params), summed
    assert gate_weight.is_contiguous() and norm_weight.is_contiguous()
    x, residual = x.contiguous(), residual.contiguous()
    logits = torch.empty((t, e), device=x.device, dtype=x.dtype)
    summed, h = torch.empty_like(x), torch.empty_like(x)
    weights = torch.empty((t, top_k), device=x.device, dtype=torch.float32)
    ids = torch.empty((t, top_k), device=x.device, dtype=torch.int32)
    fused = p["decode_split_down"] == 3  # the experts route for themselves
    cnt = (counters or fresh_counters)(1, x.device) if route_by_last and not fused else ids
    _norm_router_kernel[(triton.cdiv(e, router_block_n),)](
        x, residual, norm_weight, gate_weight, logits, summed, h, weights, ids, cnt, t, e, eps,
        K=hidden, TOP_K=top_k, RENORM=renormalize, BLOCK_M=triton.next_power_of_2(t), BLOCK_N=router_block_n,
        BLOCK_K=router_block_k, BLOCK_E=triton.next_power_of_2(e), K_PAD=triton.next_power_of_2(top_k),
        ROUTE=bool(route_by_last) and not fused,
        num_warps=router_warps, **launch_options(pdl, x))
    if fused:
        return _fused_experts(h, logits, w13, w2, top_k, renormalize, p["decode_chunk"], p["decode_block_k"],
                              p["decode_down_block_n"], p["decode_warps"], p["decode_stages"], pdl, counters), summed
    if not route_by_last:
        weights, ids = moe_route_triton(logits, top_k, renormalize, pdl, p["decode_route_rank"])
    return _pair_experts(h, weights, ids, w13, w2, top_k, p["decode_block_n"], p["decode_block_k"],
                         p["decode_down_block_n"], p["decode_warps"], p["decode_split_down"], pdl,
                         p["decode_down_early"], p["decode_down_block_k"], p["decode_stages"],
                         p["decode_evict"], p["decode_act"]), summed


def make_norm_moe(**params):
    """The norm_moe callable for a variant: ``norm_moe_triton`` with its parameters (checked here) and this table's
    own routing arrival counter."""
    check_moe_params(params, {**_MOE_PARAMS, **_NORM_MOE_PARAMS})
    return functools.partial(norm_moe_triton, **params, counters=ArrivalCounters())


# norm_moe_triton's own tunable parameters (beside moe_triton's) and their defaults
_NORM_MOE_PARAMS = {k: p.default for k, p in inspect.signature(norm_moe_triton).parameters.items()
                    if p.default is not inspect.Parameter.empty and k != "counters"}
