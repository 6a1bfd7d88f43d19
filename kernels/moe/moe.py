"""Mixture-of-experts: top-k routing and the experts' gated MLPs over the routed tokens."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_route_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: (T, E). Returns (weights (T, k) float32, expert ids (T, k) int64).

    Softmax over all experts, then top-k, then (optionally) renormalized over the k:
    Qwen3-MoE's rule; Mixtral's softmax over the top-k logits is the renormalized case.
    """
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_ref(
    x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int, renormalize: bool
) -> torch.Tensor:
    """x: (T, H); router_logits: (T, E); w13: (E, 2I, H) holding [gate | up]; w2: (E, H, I). Returns (T, H)."""
    weights, ids = moe_route_ref(router_logits, top_k, renormalize)
    weights = weights.to(x.dtype)
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        token, slot = torch.where(ids == e)
        h = F.linear(x[token], w13[e])
        half = h.shape[-1] // 2
        h = F.silu(h[:, :half]) * h[:, half:]
        y = F.linear(h, w2[e]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(x.dtype))
    return out


def norm_moe_ref(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_weight: torch.Tensor,
    w13: torch.Tensor, w2: torch.Tensor, top_k: int, renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE block after attention: returns (moe(h, router(h)), x + residual), h = rms_norm(x + residual).

    x, residual: (T, H); gate_weight: (E, H), the router; the rest as in ``moe_ref``.
    """
    from kernels.pointwise.norm import fused_add_rms_norm_ref

    h, summed = fused_add_rms_norm_ref(x, residual, norm_weight, eps)
    return moe_ref(h, F.linear(h, gate_weight), w13, w2, top_k, renormalize), summed
