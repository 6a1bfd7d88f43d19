"""W8A8 FP8 projections for many rows (prefill, chunked-prefill steps, wide decode batches): e4m3 weights with a
scale per output channel (kernels/linear/quant.py) times e4m3 activations with a scale per row, on the FP8 tensor
cores, both scales applied in the GEMM's epilogue (``torch._scaled_mm`` row-wise).

What makes it pay is where the activations are quantized: a separate pass over a bf16 activation (the residual add
+ RMSNorm before QKV and gate_up, SiLU-and-multiply before down) writes it, reads it back, then writes its codes.
The Triton forms (kernels/linear/w8a8_triton.py) produce the codes and the row's scale in the kernel that computes
the activation, so the bf16 activation never reaches memory. The attention's output before o_proj is quantized in
one launch of its own (kernels/linear/quant_triton.py): a row's scale needs every head's output, and the heads are
computed by different programs of the attention kernel.

These are the plain-torch references of the same signatures: the activation in the checkpoint's dtype as the
reference norm and activation round it, then ``quantize_rows`` (scale = max(amax / 448, 1e-12)).
"""
from __future__ import annotations

import torch

from kernels.linear.quant import QuantizedWeight, quantize_rows
from kernels.pointwise.activation import silu_and_mul_ref
from kernels.pointwise.norm import fused_add_rms_norm_ref

MAX_NORM_D = 16384  # the widest row the Triton norm kernel holds in registers (wider rows: the unfused path)


def add_rms_norm_fp8_ref(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, residual: (T, K) -> (e4m3 codes (T, K), float32 row scales (T, 1), x + residual (T, K)): the codes of
    rms_norm(x + residual) as the reference norm rounds it."""
    h, summed = fused_add_rms_norm_ref(x, residual, norm_weight, eps)
    q, s = quantize_rows(h)
    return q, s, summed


def silu_and_mul_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (T, 2I) holding [gate | up] -> (e4m3 codes of silu(gate) * up (T, I), float32 row scales (T, 1))."""
    return quantize_rows(silu_and_mul_ref(x))


def fp8_rows_mm(q: torch.Tensor, scale: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None,
                fast_accum: bool = False) -> torch.Tensor:
    """q: (T, K) e4m3, scale: (T, 1) float32, weight: (N, K) e4m3 -> (T, N) in the weight's checkpoint dtype:
    sum_k q[t, k] w[n, k] * scale[t] * weight.scale[n] in float32, rounded once. ``fast_accum``: the partial sums
    kept in the tensor cores' own accumulator (faster on Hopper, fewer mantissa bits over long rows) instead of
    promoted to float32 (cuBLAS's default)."""
    if weight.kind != "fp8":
        raise ValueError(f"fp8_rows_mm takes FP8 weights, got {weight.kind}")
    if q.shape[1] != weight.q.shape[1]:
        raise ValueError(f"codes of {q.shape[1]} columns against a weight of {tuple(weight.q.shape)}")
    out = torch._scaled_mm(q, weight.q.t(), scale_a=scale, scale_b=weight.scale[None, :], out_dtype=weight.dtype,
                           use_fast_accum=fast_accum)
    return out if bias is None else out + bias


def supports(x: torch.Tensor, weight) -> bool:
    """Whether the W8A8 GEMM takes this product: FP8 weights of 16-multiple sides (the tensor cores' alignment)."""
    return (isinstance(weight, QuantizedWeight) and weight.kind == "fp8" and weight.q.shape[0] % 16 == 0
            and weight.q.shape[1] % 16 == 0 and x.shape[0] > 0)


def norm_linear_w8a8_ref(x, residual, norm_weight, eps, weight: QuantizedWeight, bias=None):
    """``norm_linear``'s signature: (linear(rms_norm(x + residual)), x + residual) through the W8A8 GEMM."""
    q, s, summed = add_rms_norm_fp8_ref(x, residual, norm_weight, eps)
    return fp8_rows_mm(q, s, weight, bias), summed


def act_linear_w8a8_ref(x, weight: QuantizedWeight):
    """``act_linear``'s signature: linear(silu(gate) * up) through the W8A8 GEMM."""
    q, s = silu_and_mul_fp8_ref(x)
    return fp8_rows_mm(q, s, weight)


def linear_w8a8_ref(x, weight: QuantizedWeight, bias=None):
    """``linear``'s signature: x quantized per row, then the W8A8 GEMM."""
    q, s = quantize_rows(x)
    return fp8_rows_mm(q, s, weight, bias)
