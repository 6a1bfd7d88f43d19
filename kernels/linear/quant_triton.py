"""The activations' per-row FP8 quantization in one launch, before an FP8 tensor-core GEMM.

``kernels.linear.quant.quantize_rows`` (the plain-torch path) quantizes a GEMM's input in seven small kernels (to float32,
abs, the row maximum, the scale, its clamp, the division, the conversion): in a decode step of the 8B, 128
projections each pay those launches, about 2 ms of a 5 ms step measured on an H200 (bench/RESULTS.md). Here one
program per row finds the row's largest |x| and writes e4m3 values and the row's float32 scale, the same
definition as the plain-torch path: scale = max(amax / 448, 1e-12), q = e4m3(x / scale). The Triton linear
kernels pass it to ``kernels.linear.quant.qlinear`` for the rows they leave to the GEMM.

GPU only: the Triton interpreter converts to e4m3 differently from the hardware and torch (-126.9 becomes -64
instead of -128), so the CPU cannot check this kernel; ``bench/gpu/suite.py --only precision-serve`` checks it
against the plain-torch path on the device first.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.linear.quant import FP8_MAX


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, FP8_MAX: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    x_row = x_ptr + row * stride_x
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, 1e-12)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * stride_q + offs, tl.div_rn(v, scale).to(q_ptr.dtype.element_ty), mask=offs < K)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (T, K) on a GPU -> (e4m3 (T, K), float32 scales (T, 1)) with x ~= q * scale."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    if not x.is_cuda or x.dim() != 2:
        raise ValueError(f"quantize_rows_fp8 takes a 2-D CUDA tensor, got {tuple(x.shape)} on {x.device}")
    t, k = x.shape
    q = torch.empty(t, k, device=x.device, dtype=torch.float8_e4m3fn)
    s = torch.empty(t, 1, device=x.device, dtype=torch.float32)
    if t:
        block = min(triton.next_power_of_2(k), 2048)
        _quantize_rows_kernel[(t,)](x, q, s, k, x.stride(0), q.stride(0), FP8_MAX=FP8_MAX, BLOCK_K=block,
                                    num_warps=4 if block <= 1024 else 8)
    return q, s

