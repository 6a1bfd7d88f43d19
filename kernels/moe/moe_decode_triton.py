"""The MoE decode path's experts: few routed (token, slot) pairs, nothing read back on the host, so a step
can be captured in a CUDA graph, and each routed expert's weights read once per pair (the bytes a decode step
must move).

``_pair_experts``: after the routing kernel (kernels/moe/moe_route_triton.py), per-pair matrix-vector kernels for
gate/up and down, and the experts' sum (in the down kernel or a launch of its own). ``_fused_experts``: all of
it in one launch that routes for itself and sums by atomics. Both read their tiles and forms from
``MoeParams`` (kernels/moe/moe_params.py); ``moe_triton`` (kernels/moe/moe_triton.py) chooses between them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pointwise.activation_triton import silu_mul
from kernels.counters import fresh_counters
from kernels.moe.moe_params import MoeParams
from kernels.moe.moe_route_triton import _route_slot
from kernels.pdl import launch_options, pdl_enter


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


def _pair_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  top_k: int, p: MoeParams) -> torch.Tensor:
    """The routed experts of the decode path: per (token, slot) pair matrix-vector products. x: (T, H); weights,
    ids: (T, k) from the routing; w13: (E, 2I, H); w2: (E, H, I). Tiles and forms from ``p`` (``decode_*``,
    ``pdl``). Returns (T, H)."""
    block_n, block_k, down_block_n = p.decode_block_n, p.decode_block_k, p.decode_down_block_n
    down_block_k = p.decode_down_block_k or block_k
    num_warps, num_stages, split_down, act = p.decode_warps, p.decode_stages, p.decode_split_down, p.decode_act
    t, h = x.shape
    i = w2.shape[2]
    assert w13.is_contiguous() and w2.is_contiguous()
    x = x.contiguous()
    opts = launch_options(p.pdl, x)
    evict = "evict_first" if p.decode_evict else ""
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
        num_warps=num_warps, num_stages=num_stages,
        **(launch_options(1, x) if p.decode_down_early and p.pdl else opts))
    out = torch.empty_like(x)
    if split_down:
        part = torch.empty((t * top_k, h), device=x.device, dtype=torch.float32)
        _pair_down_split_kernel[(t * top_k, n_blocks)](
            gate_up, w2, ids, weights, part, out, cnt if cnt is not None else ids, h, w2.stride(0), w2.stride(1),
            I=i, TOP_K=top_k, SUM=cnt is not None, EARLY=bool(p.decode_down_early), BLOCK_N=down_block_n,
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


def _fused_experts(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
                   renormalize: bool, p: MoeParams, scratch=None) -> torch.Tensor:
    """The decode path in one launch (``_fused_experts_kernel``): ``decode_chunk`` rows of the intermediate per
    program, ``decode_block_k`` and ``decode_down_block_n`` its tiles; ``scratch(n, device, dtype)``: zeroed
    buffers the kernel leaves zeroed (the float32 sum and the arrival counter; default: fresh per call)."""
    t, h = x.shape
    e, i = router_logits.shape[1], w2.shape[2]
    assert w13.is_contiguous() and w2.is_contiguous()
    x, logits = x.contiguous(), router_logits.contiguous()
    scratch = scratch or fresh_counters
    acc = scratch(t * h, x.device, torch.float32)
    cnt = scratch(1, x.device, torch.int32)
    out = torch.empty_like(x)
    chunk = p.decode_chunk
    _fused_experts_kernel[(t * top_k, triton.cdiv(i, chunk))](
        x, logits, w13, w2, acc, out, cnt, t, e, w13.stride(0), w13.stride(1), w2.stride(0), w2.stride(1), H=h, I=i,
        TOP_K=top_k, RENORM=renormalize, BLOCK_E=triton.next_power_of_2(e), CHUNK=chunk,
        C_PAD=triton.next_power_of_2(chunk), BLOCK_K=p.decode_block_k, BLOCK_N=p.decode_down_block_n,
        num_warps=p.decode_warps, num_stages=p.decode_stages, **launch_options(p.pdl, x))
    return out
