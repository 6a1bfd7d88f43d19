"""Weight-only quantization of the linear layers: int8 and FP8 (e4m3) weights with one scale per output channel.

A ``QuantizedWeight`` holds the quantized matrix ``q`` (N, K) and its float32 ``scale`` (N,), so that
``weight ~= q * scale[:, None]``. Symmetric, per output channel, scale = the row's largest |w| over the
format's largest value (127 for int8, 448 for e4m3), so no value clips. Quantizing is done once, when a
variant is prepared (engine/model/precision.py); the forward pass only reads ``q`` and ``scale``.

``qlinear`` is the plain-torch path, the "reference" linear with quantized weights:
- rows <= ``max_m`` (decode) of int8 weights on a CPU, K a multiple of 16: torch's int8 weight-pack matmul, which reads one
  byte per weight (the activations in bfloat16, which that kernel vectorizes; measured 2-3x faster than the
  float32 matmul on SmolLM2's projections at 1-8 rows, and slower than it from about 16 rows);
- FP8 weights on a GPU with FP8 tensor cores (compute capability >= 8.9), any rows: the activations
  quantized to e4m3 per row, then torch's scaled matrix multiply (an FP8 tensor-core GEMM, float32 sums);
- otherwise the dequantized weights in the activations' dtype times the activations, the dequantized
  copy kept beside ``q`` when ``keep_dequantized`` (CPU: dequantizing per call costs more than the matmul).
The Triton matrix-vector kernel (kernels/linear/linear_triton.py) reads ``q`` and applies ``scale`` in registers.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

WEIGHT_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
FP8_MAX = 448.0  # e4m3's largest finite value
_QMAX = {"int8": 127.0, "fp8": FP8_MAX}


@dataclass(eq=False)
class QuantizedWeight:
    """A weight (N, K) as ``q * scale[:, None]``."""

    kind: str  # "int8" or "fp8"
    q: torch.Tensor  # (N, K) int8 or float8_e4m3fn, rows contiguous
    scale: torch.Tensor  # (N,) float32
    dtype: torch.dtype  # the checkpoint's dtype: what the layer computes in and returns
    dequantized: torch.Tensor | None = field(default=None, repr=False)  # (N, K) in ``dtype``, when kept

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scale.numel() * 4

    def dequantize(self) -> torch.Tensor:
        """(N, K) in ``dtype``: the values this weight stands for."""
        if self.dequantized is not None:
            return self.dequantized
        return (self.q.to(torch.float32) * self.scale[:, None]).to(self.dtype)


def quantize(weight: torch.Tensor, kind: str, keep_dequantized: bool = False) -> QuantizedWeight:
    """weight: (N, K) float -> its per-output-channel symmetric quantization. Computed in float32."""
    if kind not in WEIGHT_DTYPES:
        raise ValueError(f"unknown weight dtype {kind!r}; known: {', '.join(WEIGHT_DTYPES)}")
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"quantize takes a 2-D float weight, got {tuple(weight.shape)} {weight.dtype}")
    w = weight.detach().to(torch.float32)
    amax = w.abs().amax(dim=1)
    if not torch.isfinite(amax).all():
        raise ValueError("the weight holds NaN or Inf: it cannot be quantized")
    scale = torch.where(amax > 0, amax / _QMAX[kind], torch.ones_like(amax))
    scaled = w / scale[:, None]
    q = scaled.round().clamp(-127, 127).to(torch.int8) if kind == "int8" else scaled.to(torch.float8_e4m3fn)
    qw = QuantizedWeight(kind, q.contiguous(), scale.contiguous(), weight.dtype)
    if keep_dequantized:
        qw.dequantized = qw.dequantize()
    return qw


def fp8_gemm_supported(device: torch.device) -> bool:
    """Whether ``device`` has FP8 tensor cores (Ada, Hopper and later). Asked per projection of a step, so the
    answer is kept per device: the capability query costs microseconds of host time a call."""
    return device.type == "cuda" and _fp8_capable(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _fp8_capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (T, K) -> (e4m3 (T, K), float32 scales (T, 1)) with x ~= q * scale: scale = max(amax / 448, 1e-12)."""
    xf = x.to(torch.float32)
    xs = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (xf / xs).to(torch.float8_e4m3fn), xs


def _fp8_gemm(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None,
              quantize=quantize_rows) -> torch.Tensor:
    """x: (T, K) -> (T, N) through an FP8 tensor-core GEMM; x quantized to e4m3 per row by ``quantize``
    (``quantize_rows``, or its one-launch Triton form: kernels/linear/quant_triton.py)."""
    xq, xs = quantize(x)
    out = torch._scaled_mm(xq, qw.q.t(), scale_a=xs, scale_b=qw.scale[None, :], out_dtype=x.dtype)
    return out if bias is None else out + bias


def qlinear(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None, max_m: int = 8,
            quantize=quantize_rows) -> torch.Tensor:
    """x: (T, K) in the checkpoint's dtype, qw: (N, K) -> (T, N), the plain-torch way (see the module's
    docstring for which path a call takes); ``quantize``: how the FP8 GEMM's input is quantized per row."""
    t, k = x.shape
    n = qw.q.shape[0]
    if qw.q.shape[1] != k:
        raise ValueError(f"input of {k} columns against a weight of {tuple(qw.q.shape)}")
    # torch's int8 weight-pack matmul returns garbage or crashes on AVX-512 CPUs for K not a multiple of 16 (K
    # 200 and 232 measured on a Xeon with AMX, torch 2.13; 16-multiples exact): such layers take the path below
    if qw.kind == "int8" and x.device.type == "cpu" and 0 < t <= max_m and k % 16 == 0:
        out = torch._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), qw.q, qw.scale.to(torch.bfloat16))
        out = out.to(x.dtype)
        return out if bias is None else out + bias
    if qw.kind == "fp8" and t > 0 and fp8_gemm_supported(x.device) and k % 16 == 0 and n % 16 == 0:
        return _fp8_gemm(x, qw, bias, quantize)
    return F.linear(x, qw.dequantize(), bias)


def qlinear_exact(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The float64 product of x and the dequantized weight: what every path above approximates (tests)."""
    w = qw.q.to(torch.float64) * qw.scale.to(torch.float64)[:, None]
    out = x.to(torch.float64) @ w.t()
    return out if bias is None else out + bias.to(torch.float64)
