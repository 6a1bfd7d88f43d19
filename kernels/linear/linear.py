"""Linear layers, alone and fused with the operation that produces their input.

``norm_linear`` is the residual add + RMSNorm before a projection (the attention's QKV and the
MLP's gate/up), ``act_linear`` the SiLU-and-multiply before the MLP's down projection. Fusing
them into the matrix-vector product of a decode step removes a kernel launch and a round trip
of the activation through memory per projection.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.pointwise.activation import silu_and_mul_ref
from kernels.pointwise.norm import fused_add_rms_norm_ref
from kernels.linear.quant import QuantizedWeight, qlinear


def linear_ref(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None
               ) -> torch.Tensor:
    """x: (T, K), weight: (N, K), plain or quantized (kernels/linear/quant.py), bias: (N,) or None -> (T, N)."""
    if isinstance(weight, QuantizedWeight):
        return qlinear(x, weight, bias)
    if x.device.type == "cpu" and bias is None and 1 < x.shape[0] <= 64 and weight.shape[0] >= 32768:
        # a few rows against the vocabulary (prefill ends, speculation's verification): with the weight on the
        # left the CPU's GEMM runs 2-3x faster than F.linear's (bench/RESULTS.md); the same sums, maybe added in
        # another order
        return (weight @ x.t()).t().contiguous()
    return F.linear(x, weight, bias)


def norm_linear_ref(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (linear(rms_norm(x + residual)), x + residual). x, residual: (T, K); weight: (N, K)."""
    h, summed = fused_add_rms_norm_ref(x, residual, norm_weight, eps)
    return linear_ref(h, weight, bias), summed


def act_linear_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: (T, 2K) holding [gate | up]; weight: (N, K) -> linear(silu(gate) * up), (T, N)."""
    return linear_ref(silu_and_mul_ref(x), weight)
