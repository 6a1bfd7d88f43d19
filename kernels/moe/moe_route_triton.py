"""Triton routing for the MoE decode path; same contract as ``kernels.moe.moe.moe_route_ref`` (ids as int32).

The routing helpers are shared by the kernels that route for themselves: the norm + router launch
(``_route_row``, kernels/moe/moe_triton.py) and the one-launch experts (``_route_slot``,
kernels/moe/moe_decode_triton.py). Every form takes the softmax in float32 and the top k with the lowest index
first on ties, as the reference's stable sort.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import launch_options, pdl_enter


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


def moe_route_triton(router_logits: torch.Tensor, top_k: int, renormalize: bool, pdl: int = 0, rank: int = 0
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``kernels.moe.moe.moe_route_ref`` (ids as int32): weights (T, k) float32, ids (T, k).
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

