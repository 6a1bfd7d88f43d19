"""Triton mixture-of-experts; same signature as ``kernels.moe.moe.moe_ref``. Two paths:

- few routed (token, slot) pairs (decode): a fused routing kernel (softmax, top-k,
  renormalization; kernels/moe/moe_route_triton.py) and two matrix-vector kernels that read each
  pair's expert from a device tensor (or all of it in one kernel that routes for itself and sums
  by atomics; kernels/moe/moe_decode_triton.py). Nothing goes back to the host, so the step can be
  captured in a CUDA graph, and each routed expert's weights are read once per pair: the bytes a
  decode step must move.
- many pairs (prefill): routing is the reference's; the pairs are sorted by expert and padded
  to whole BLOCK_M tiles, so every program of the grouped matmul (here) multiplies rows of one
  expert only (the grouping reads the counts on the host).

``norm_moe_triton`` is the whole block after attention (residual add, RMSNorm, router, routing,
experts): for a decode batch the first four are one launch.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.pointwise.activation import silu_and_mul_ref
from kernels.counters import ArrivalCounters, fresh_counters
from kernels.linear.linear_triton import _add_rms_rstd, _gemv_rows
from kernels.moe.moe import moe_route_ref
from kernels.moe.moe_decode_triton import _fused_experts, _pair_experts
from kernels.moe.moe_params import MoeParams, NormMoeParams
from kernels.moe.moe_route_triton import _route_row, moe_route_triton
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


def moe_triton(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
               renormalize: bool, params: MoeParams = MoeParams(), *, scratch=None, **changes: int) -> torch.Tensor:
    """x: (T, H); router_logits: (T, E); w13: (E, 2I, H) holding [gate | up]; w2: (E, H, I). Returns (T, H).

    Up to ``params.max_decode_pairs`` routed pairs (any number while a CUDA graph is captured) take the
    device-only decode path (kernels/moe/moe_decode_triton.py), more the grouped matmul. ``params``: the tiles and
    forms (kernels/moe/moe_params.py); ``changes``: some of its fields replaced for this call, by name
    (``moe_triton(..., decode_split_down=2)``); ``scratch(n, device, dtype)``: the one-launch form's zeroed sum
    and counter (default: fresh per call; ``make_moe`` keeps them).
    """
    p = params.replace(**changes) if changes else params
    t, h = x.shape
    assert w13.shape[2] == h and w2.shape[1] == h and w13.shape[1] == 2 * w2.shape[2]
    if t == 0:
        return torch.empty_like(x)
    # the grouped path reads counts on the host, which a CUDA graph capture cannot: capture the decode path
    if t * top_k <= p.max_decode_pairs or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        if p.decode_split_down == 3:
            return _fused_experts(x, router_logits, w13, w2, top_k, renormalize, p, scratch)
        weights, ids = moe_route_triton(router_logits, top_k, renormalize, p.pdl, p.decode_route_rank)
        return _pair_experts(x, weights, ids, w13, w2, top_k, p)
    weights, ids = moe_route_ref(router_logits, top_k, renormalize)
    pairs, tile_expert = _group_by_expert(ids, w13.shape[0], p.block_m)
    num_pairs = t * top_k
    x = x.contiguous()
    tiles = (p.block_m, p.block_n, p.block_k)
    gate_up = _grouped_matmul(x, w13, pairs, tile_expert, num_pairs, top_k, None, *tiles)
    act = silu_and_mul_ref(gate_up)  # (T * k, I)
    down = _grouped_matmul(act, w2, pairs, tile_expert, num_pairs, 1, weights.to(x.dtype).reshape(-1).contiguous(),
                           *tiles)
    return down.view(t, top_k, h).sum(dim=1)


def make_moe(**params: int) -> functools.partial:
    """The moe callable for a variant: ``moe_triton`` with ``MoeParams`` built from ``params`` (``ValueError``
    names a bad one) and this table's own zeroed sum and counter for the one-launch form."""
    return functools.partial(moe_triton, params=MoeParams.from_params(params), scratch=ArrivalCounters())


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


def norm_moe_triton(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                    gate_weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int, renormalize: bool,
                    params: NormMoeParams = NormMoeParams(), *, counters=None,
                    **changes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``kernels.moe.moe.norm_moe_ref``. A decode batch (at most 4 tokens and ``max_decode_pairs``
    pairs) takes one launch for the residual add, RMSNorm and router (``router_*`` tiles) and, with
    ``route_by_last``, routing by its last program (else the routing kernel after it), then the decode path's
    expert kernels (with ``decode_split_down`` 3 the experts' one launch, which routes for itself); larger
    batches the Triton norm, torch's router and ``moe_triton``. ``params``: the tiles and forms
    (kernels/moe/moe_params.py); ``changes``: some of its fields replaced for this call, by name; ``counters(n,
    device, dtype)``: the routing's arrival counter, or the one-launch experts' sum and counter (default: zeroed
    per call; ``make_norm_moe`` keeps them)."""
    from kernels.pointwise.norm_triton import fused_add_rms_norm_triton

    p = params.replace(**changes) if changes else params
    t, hidden = x.shape
    e = gate_weight.shape[0]
    assert residual.shape == x.shape and norm_weight.shape == (hidden,) and gate_weight.shape == (e, hidden)
    if not 0 < t <= 4 or t * top_k > p.max_decode_pairs:
        h, summed = fused_add_rms_norm_triton(x, residual, norm_weight, eps, pdl=p.pdl)
        return moe_triton(h, torch.nn.functional.linear(h, gate_weight), w13, w2, top_k, renormalize, p), summed
    assert gate_weight.is_contiguous() and norm_weight.is_contiguous()
    x, residual = x.contiguous(), residual.contiguous()
    logits = torch.empty((t, e), device=x.device, dtype=x.dtype)
    summed, h = torch.empty_like(x), torch.empty_like(x)
    weights = torch.empty((t, top_k), device=x.device, dtype=torch.float32)
    ids = torch.empty((t, top_k), device=x.device, dtype=torch.int32)
    fused = p.decode_split_down == 3  # the experts route for themselves
    cnt = (counters or fresh_counters)(1, x.device) if p.route_by_last and not fused else ids
    _norm_router_kernel[(triton.cdiv(e, p.router_block_n),)](
        x, residual, norm_weight, gate_weight, logits, summed, h, weights, ids, cnt, t, e, eps,
        K=hidden, TOP_K=top_k, RENORM=renormalize, BLOCK_M=triton.next_power_of_2(t), BLOCK_N=p.router_block_n,
        BLOCK_K=p.router_block_k, BLOCK_E=triton.next_power_of_2(e), K_PAD=triton.next_power_of_2(top_k),
        ROUTE=bool(p.route_by_last) and not fused,
        num_warps=p.router_warps, **launch_options(p.pdl, x))
    if fused:
        return _fused_experts(h, logits, w13, w2, top_k, renormalize, p, counters), summed
    if not p.route_by_last:
        weights, ids = moe_route_triton(logits, top_k, renormalize, p.pdl, p.decode_route_rank)
    return _pair_experts(h, weights, ids, w13, w2, top_k, p), summed


def make_norm_moe(**params: int) -> functools.partial:
    """The norm_moe callable for a variant: ``norm_moe_triton`` with ``NormMoeParams`` built from ``params``
    (``ValueError`` names a bad one) and this table's own routing arrival counter."""
    return functools.partial(norm_moe_triton, params=NormMoeParams.from_params(params), counters=ArrivalCounters())
