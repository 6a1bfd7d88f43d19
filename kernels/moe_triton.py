"""Triton mixture-of-experts: routed tokens grouped by expert, then two grouped matmuls.

Same signature as ``kernels.moe.moe_ref``. Routing (softmax, top-k, renormalization) is the
reference's; the (token, slot) pairs are sorted by expert and padded to whole BLOCK_M tiles,
so every program of the grouped matmul multiplies rows of one expert only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.activation import silu_and_mul_ref
from kernels.moe import moe_route_ref


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


def moe_triton(
    x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int, renormalize: bool,
    block_m: int = 16, block_n: int = 32, block_k: int = 32,
) -> torch.Tensor:
    """x: (T, H); router_logits: (T, E); w13: (E, 2I, H) holding [gate | up]; w2: (E, H, I). Returns (T, H)."""
    t, h = x.shape
    assert w13.shape[2] == h and w2.shape[1] == h and w13.shape[1] == 2 * w2.shape[2]
    if t == 0:
        return torch.empty_like(x)
    weights, ids = moe_route_ref(router_logits, top_k, renormalize)
    pairs, tile_expert = _group_by_expert(ids, w13.shape[0], block_m)
    num_pairs = t * top_k
    x = x.contiguous()
    gate_up = _grouped_matmul(x, w13, pairs, tile_expert, num_pairs, top_k, None, block_m, block_n, block_k)
    act = silu_and_mul_ref(gate_up)  # (T * k, I)
    down = _grouped_matmul(act, w2, pairs, tile_expert, num_pairs, 1, weights.to(x.dtype).reshape(-1).contiguous(),
                           block_m, block_n, block_k)
    return down.view(t, top_k, h).sum(dim=1)
