"""Triton matrix-vector products for decode steps; same signatures as ``kernels.linear.linear``.

A decode step of a few sequences multiplies a handful of rows by each weight matrix, so its
time is the time to stream the weights once. The kernel gives each program ``BLOCK_N`` output
columns and walks K in ``BLOCK_K`` chunks, reading each weight element once for all (at most
``max_m``) rows; many small programs per SM keep enough loads in flight to saturate HBM.
Optionally the input is produced on the fly inside the loop: the residual add + RMSNorm before
a projection (statistics in a first pass over the row, which sits in L2), or SiLU-and-multiply
before the down projection. Batches of more than ``max_m`` rows (prefill) go to the plain-torch
matrix multiply, after the Triton norm or activation kernel.

Weights may be quantized (``kernels.linear.quant.QuantizedWeight``: int8 or FP8 with a scale per output column):
the kernel reads the one-byte weights, converts them in registers and applies the scales to the sums;
larger batches go to ``kernels.linear.quant.qlinear`` (an FP8 tensor-core GEMM, or the dequantized weights).

Tile sizes come from the kernel parameters (``block_n``, ``block_k``, ``num_warps``) when a
variant fixes them, and otherwise from Triton's autotuner, per (rows, N, K, prologue), timed on
the device; on CPU (``TRITON_INTERPRET=1``) the default tiles are used. With autotuned tiles on a
GPU, each shape is also timed once against the plain-torch path (cuBLAS, after the Triton norm or
activation kernel) and keeps the faster of the two: cuBLAS wins some shapes (measured on an H200:
the norm-fused prologue re-reads the row in every program, which costs more than the separate norm
kernel on wide projections).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.pointwise.activation_triton import silu_mul
from kernels.pdl import launch_options, pdl_enter
from kernels.linear.quant import QuantizedWeight, qlinear
from kernels.timing import graph_time, interpreted as _interpreted

NONE, SILU_MUL, ADD_RMS_NORM = 0, 1, 2  # input prologues
# elements (rows x columns) of x + residual the norm prologue loads at once for the row's statistics: its
# pass before the first product waits on each load, so fewer, larger loads start the products sooner; 0: the
# weights' BLOCK_K
RSTD_ELEMENTS = 4096
DEFAULT_TILES = {"block_n": 8, "block_k": 512, "num_warps": 4}
# (BLOCK_N, BLOCK_K, warps): small programs, many per SM, so loads from many programs overlap
AUTOTUNE_TILES = ((4, 512, 4), (8, 256, 4), (8, 512, 4), (8, 1024, 8), (16, 256, 4), (16, 512, 8), (32, 256, 8),
                  (2, 1024, 4), (32, 512, 8), (64, 256, 8),
                  # longer rows per program keep as many bytes in flight with one-byte (quantized) weights
                  (4, 2048, 4), (8, 2048, 8), (16, 1024, 8), (4, 4096, 8), (16, 2048, 8))


@triton.jit
def _w_float(w):
    """Weights as float32. int8 through the float bit pattern of 1.5 * 2^23 + w (integer adds at full rate)
    instead of the int-to-float conversion, which runs at a quarter rate and capped the int8 GEMV at about
    half the HBM bandwidth on an H200 (bench/RESULTS.md). FP8 through the conversion instruction: moving e4m3's
    bits into float32's places with integer operations measured slower on an H200 (2026-12-02, bench/RESULTS.md)."""
    if w.dtype == tl.int8:
        return (w.to(tl.int32) + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
    return w.to(tl.float32)


@triton.jit
def _gemv_chunk(acc, acc1, w, k0, x_ptr, r_ptr, nw_ptr, rm, m_mask, stride_x, stride_r, rstd,
                K: tl.constexpr, PROLOGUE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Adds one BLOCK_K chunk of the product (``w`` holds its weights) to the accumulators."""
    rk = k0 + tl.arange(0, BLOCK_K)
    k_mask = rk < K
    mk = m_mask[:, None] & k_mask[None, :]
    if PROLOGUE == 1:  # x holds [gate | up], each K wide
        g = tl.load(x_ptr + rm[:, None] * stride_x + rk[None, :], mask=mk, other=0.0)
        u = tl.load(x_ptr + rm[:, None] * stride_x + K + rk[None, :], mask=mk, other=0.0)
        a = silu_mul(g, u)
    elif PROLOGUE == 2:
        s = tl.load(r_ptr + rm[:, None] * stride_r + rk[None, :], mask=mk, other=0.0) + tl.load(
            x_ptr + rm[:, None] * stride_x + rk[None, :], mask=mk, other=0.0)
        h = (s.to(tl.float32) * rstd[:, None]).to(s.dtype)
        a = tl.load(nw_ptr + rk, mask=k_mask, other=0.0)[None, :] * h
    else:
        a = tl.load(x_ptr + rm[:, None] * stride_x + rk[None, :], mask=mk, other=0.0)
    if BLOCK_M == 1:
        acc1 += _w_float(w) * tl.sum(a.to(tl.float32), axis=0)[None, :]
    else:
        acc += tl.sum(a.to(tl.float32)[:, None, :] * _w_float(w)[None, :, :], axis=2)
    return acc, acc1


@triton.jit
def _add_rms_rstd(x_ptr, r_ptr, sum_ptr, rm, m_mask, stride_x, stride_r, stride_sum, eps, WRITE_SUM,
                  K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """1 / RMS of each row of x + residual, over the whole row in BLOCK_K chunks; with WRITE_SUM the sum
    (the new residual) is written too."""
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        mk = m_mask[:, None] & (rk < K)[None, :]
        s = tl.load(r_ptr + rm[:, None] * stride_r + rk[None, :], mask=mk, other=0.0) + tl.load(
            x_ptr + rm[:, None] * stride_x + rk[None, :], mask=mk, other=0.0)
        if WRITE_SUM:
            tl.store(sum_ptr + rm[:, None] * stride_sum + rk[None, :], s, mask=mk)
        sf = s.to(tl.float32)
        ss += tl.sum(sf * sf, axis=1)
    return tl.rsqrt(ss / K + eps)


@triton.jit
def _gemv_rows(w_ptr, w_first, rn, n_mask, stride_w, x_ptr, r_ptr, nw_ptr, rm, m_mask, stride_x, stride_r, rstd,
               K: tl.constexpr, PROLOGUE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, EVICT: tl.constexpr):
    """(BLOCK_M, BLOCK_N) float32: the prologue's input times weight rows rn; ``w_first`` holds their first
    BLOCK_K columns, already loaded; EVICT: the weights' L2 eviction policy ("" or "evict_first")."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # one row: accumulate elementwise and reduce once at the end (no cross-thread sum per chunk)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc, acc1 = _gemv_chunk(acc, acc1, w_first, 0, x_ptr, r_ptr, nw_ptr, rm, m_mask, stride_x, stride_r, rstd,
                            K, PROLOGUE, BLOCK_M, BLOCK_K)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rn[:, None] * stride_w + rk[None, :], mask=n_mask[:, None] & (rk < K)[None, :], other=0.0,
                    eviction_policy=EVICT)
        acc, acc1 = _gemv_chunk(acc, acc1, w, k0, x_ptr, r_ptr, nw_ptr, rm, m_mask, stride_x, stride_r, rstd,
                                K, PROLOGUE, BLOCK_M, BLOCK_K)
    if BLOCK_M == 1:
        acc = tl.sum(acc1, axis=1)[None, :]
    return acc


@triton.jit
def _gemv_kernel(
    x_ptr, r_ptr, nw_ptr, w_ptr, s_ptr, b_ptr, out_ptr, sum_ptr,
    M, N, stride_x, stride_r, stride_w, stride_out, stride_sum, eps,
    K: tl.constexpr,  # a compile-time bound keeps the loop a plain counted loop (and the interpreter happy)
    PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVICT: tl.constexpr = "",
    PDL: tl.constexpr = 0, RSTD_BLOCK: tl.constexpr = 0,
):
    pid = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    # the first chunk of weights is requested before waiting for the kernel that writes x (kernels/pdl.py)
    rk0 = tl.arange(0, BLOCK_K)
    w_first = tl.load(w_ptr + rn[:, None] * stride_w + rk0[None, :], mask=n_mask[:, None] & (rk0 < K)[None, :],
                      other=0.0, eviction_policy=EVICT)
    pdl_enter(PDL)
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if PROLOGUE == 2:  # program 0 also writes the sum (the new residual)
        if RSTD_BLOCK == 0:  # the row's statistics in the weights' chunks
            rstd = _add_rms_rstd(x_ptr, r_ptr, sum_ptr, rm, m_mask, stride_x, stride_r, stride_sum, eps, pid == 0,
                                 K, BLOCK_M, BLOCK_K)
        else:  # in chunks of their own: the whole row in one or a few loads, not K / BLOCK_K round trips to L2
            rstd = _add_rms_rstd(x_ptr, r_ptr, sum_ptr, rm, m_mask, stride_x, stride_r, stride_sum, eps, pid == 0,
                                 K, BLOCK_M, RSTD_BLOCK)
    acc = _gemv_rows(w_ptr, w_first, rn, n_mask, stride_w, x_ptr, r_ptr, nw_ptr, rm, m_mask, stride_x, stride_r,
                     rstd, K, PROLOGUE, BLOCK_M, BLOCK_N, BLOCK_K, EVICT)
    if HAS_SCALE:  # quantized weights: one scale per output column
        acc *= tl.load(s_ptr + rn, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * stride_out + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def _quick_bench(fn, quantiles):
    t = graph_time(fn)
    return [t] * len(quantiles) if quantiles else t


_gemv_tuned = triton.autotune(
    [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w) for bn, bk, w in AUTOTUNE_TILES],
    key=["BLOCK_M", "N", "K", "PROLOGUE", "HAS_BIAS", "HAS_SCALE"], do_bench=_quick_bench, cache_results=True,
)(_gemv_kernel)


# (rows, N, K, prologue, dtype, device) -> whether the Triton kernel beat the plain-torch path
_FASTER: dict[tuple, bool] = {}


def _triton_is_faster(key: tuple, triton_call, torch_call) -> bool:
    """Times both paths once per shape (L2 flushed between runs, as a decode step streams its weights)."""
    if key not in _FASTER:
        if torch.cuda.is_current_stream_capturing():
            return True  # cannot time inside a graph capture; the warm-up before it decides
        triton_call()  # autotune the tiles first
        _FASTER[key] = graph_time(triton_call) < graph_time(torch_call)
    return _FASTER[key]


def _auto(x: torch.Tensor, tiles: dict) -> bool:
    """Whether tiles are autotuned and the choice against torch is timed (a GPU, no tiles fixed)."""
    return not tiles and x.is_cuda and not _interpreted()


def _gemv(x, weight, bias, prologue, tiles, r=None, norm_weight=None, eps=0.0, k=None, pdl=0, evict=0):
    """Launches the kernel for x's rows (x is the prologue's input); returns (out, summed or None). ``evict``: the
    weights read with the L2 "evict first" policy (streamed through once)."""
    scale = weight.scale if isinstance(weight, QuantizedWeight) else None
    weight = weight.q if scale is not None else weight
    m, n = x.shape[0], weight.shape[0]
    k = weight.shape[1] if k is None else k
    assert weight.stride(1) == 1, "weight rows must be contiguous"
    assert x.stride(1) == 1, "input rows must be contiguous"
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    summed = torch.empty(m, k, device=x.device, dtype=x.dtype) if prologue == ADD_RMS_NORM else out
    r = x if r is None else r
    norm_weight = weight if norm_weight is None else norm_weight
    b = weight if bias is None else bias
    args = (x, r, norm_weight, weight, weight if scale is None else scale, b, out, summed, m, n, x.stride(0),
            r.stride(0), weight.stride(0), out.stride(0), summed.stride(0), eps)
    block_m = max(triton.next_power_of_2(m), 1)
    meta = dict(K=k, PROLOGUE=prologue, HAS_BIAS=bias is not None, HAS_SCALE=scale is not None, BLOCK_M=block_m,
                EVICT="evict_first" if evict else "", **launch_options(pdl, x),
                RSTD_BLOCK=min(triton.next_power_of_2(k), max(RSTD_ELEMENTS // block_m, 64)) if RSTD_ELEMENTS else 0)
    if tiles or _interpreted() or not x.is_cuda:
        t = {**DEFAULT_TILES, **tiles}
        _gemv_kernel[(triton.cdiv(n, t["block_n"]),)](*args, **meta, BLOCK_N=t["block_n"], BLOCK_K=t["block_k"],
                                                      num_warps=t["num_warps"])
    else:
        _gemv_tuned[lambda c: (triton.cdiv(n, c["BLOCK_N"]),)](*args, **meta)
    return out, (summed if prologue == ADD_RMS_NORM else None)


def _matmul(x: torch.Tensor, weight, bias=None) -> torch.Tensor:
    """The library product for batches the kernel does not take (and to time the kernel against); FP8 weights
    take torch's tensor-core GEMM with their input quantized in one launch (kernels/linear/quant_triton.py)."""
    if isinstance(weight, QuantizedWeight):
        if weight.kind == "fp8" and x.is_cuda and not _interpreted():
            from kernels.linear.quant_triton import quantize_rows_fp8

            return qlinear(x, weight, bias, quantize=quantize_rows_fp8)
        return qlinear(x, weight, bias)
    return F.linear(x, weight, bias)


def _max_rows(weight, max_m: int) -> int:
    """int8 weights take the kernel up to 16 rows whatever ``max_m`` says: torch's path for them dequantizes
    the whole matrix per call (three times the bytes), which costs more than the kernel's extra arithmetic. (FP8
    weights have a tensor-core GEMM beyond ``max_m``: ``_matmul``.)"""
    return max(max_m, 16) if isinstance(weight, QuantizedWeight) and weight.kind == "int8" else max_m


def _after_prologue(h: torch.Tensor, weight, bias, tiles: dict, max_m: int, pdl: int = 0, evict: int = 0):
    """The product after a separate norm or activation kernel: torch's for plain weights; for quantized ones
    of at most ``max_m`` rows the kernel without a prologue, since torch has no matrix-vector product for
    one-byte weights (its FP8 GEMM quantizes the activations first, a pass of its own per call)."""
    if isinstance(weight, QuantizedWeight) and 0 < h.shape[0] <= max_m and (h.is_cuda or _interpreted()):
        return _gemv(h.contiguous(), weight, bias, NONE, tiles, pdl=pdl, evict=evict)[0]
    return _matmul(h, weight, bias)


def _key(x: torch.Tensor, weight, prologue: int) -> tuple:
    w = weight.q if isinstance(weight, QuantizedWeight) else weight
    return (x.shape[0], *w.shape, w.dtype, prologue, x.dtype, x.device)


def _tiles(block_n, block_k, num_warps) -> dict:
    return {k: v for k, v in (("block_n", block_n), ("block_k", block_k), ("num_warps", num_warps)) if v is not None}


def _on_tensor_cores(x: torch.Tensor, weight, bias, prologue: int, mma: int, min_numel: int, block_n: int,
                     block_k: int, split: int, num_warps: int, num_stages: int, **kw):
    """(out, summed or None) from the tensor-core kernel for quantized weights (kernels/linear/qmma_triton.py) when x's rows
    go there: ``mma`` > 0, at least ``mma`` rows (at most its MAX_M), and for a single row a weight of at least
    ``min_numel`` elements (on a small weight the GEMV's one launch beats the kernel's two at one row; from two rows
    the kernel wins on every 8B projection: bench/RESULTS.md); else None. The tiles a variant fixes (0: autotuned);
    ``kw``: the prologue's operands and ``pdl``."""
    if not mma or x.shape[0] < mma or not isinstance(weight, QuantizedWeight) or (
            x.shape[0] == 1 and weight.q.numel() < min_numel):
        return None
    from kernels.linear.qmma_triton import qmma, supported  # the prologue codes are this module's

    if not supported(x, weight):
        return None
    t = {"block_n": block_n, "block_k": block_k, "split_k": split, "num_warps": num_warps, "num_stages": num_stages}
    return qmma(x.contiguous(), weight, bias, prologue, {k: v for k, v in t.items() if v} if block_n else {}, **kw)


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, max_m: int = 4,
                  block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None, pdl: int = 0,
                  evict: int = 0, mma: int = 0, mma_block_n: int = 0, mma_block_k: int = 0, mma_split: int = 0,
                  mma_warps: int = 0, mma_stages: int = 0, mma_min_numel: int = 0) -> torch.Tensor:
    """x: (T, K), weight: (N, K) -> (T, N). T > max_m goes to torch's matrix multiply. ``pdl``: programmatic
    dependent launch (kernels/pdl.py); ``evict``: 1, the weights read with the L2 "evict first" policy; ``mma``:
    quantized weights times ``mma`` to 64 rows on the tensor cores (kernels/linear/qmma_triton.py, its tiles ``mma_*``,
    0: autotuned), 0: never; ``mma_min_numel``: a single row only for weights of at least that many elements."""
    got = _on_tensor_cores(x, weight, bias, NONE, mma, mma_min_numel, mma_block_n, mma_block_k, mma_split,
                           mma_warps, mma_stages, pdl=pdl)
    if got is not None:
        return got[0]
    tiles = _tiles(block_n, block_k, num_warps)
    max_m = _max_rows(weight, max_m)
    if x.shape[0] > max_m or x.shape[0] == 0:
        return _matmul(x, weight, bias)
    x = x.contiguous()
    if _auto(x, tiles) and not _triton_is_faster(
            _key(x, weight, NONE), lambda: _gemv(x, weight, bias, NONE, tiles), lambda: _matmul(x, weight, bias)):
        return _matmul(x, weight, bias)
    return _gemv(x, weight, bias, NONE, tiles, pdl=pdl, evict=evict)[0]


def norm_linear_triton(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
    bias: torch.Tensor | None = None, *, max_m: int = 4, block_n: int | None = None, block_k: int | None = None,
    num_warps: int | None = None, pdl: int = 0, evict: int = 0, mma: int = 0, mma_block_n: int = 0,
    mma_block_k: int = 0, mma_split: int = 0, mma_warps: int = 0, mma_stages: int = 0, mma_min_numel: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (linear(rms_norm(x + residual)), x + residual); x, residual: (T, K). ``evict`` and ``mma*`` as
    ``linear_triton``'s."""
    from kernels.pointwise.norm_triton import fused_add_rms_norm_triton

    assert residual.shape == x.shape and norm_weight.shape == (x.shape[1],)
    got = _on_tensor_cores(x, weight, bias, ADD_RMS_NORM, mma, mma_min_numel, mma_block_n, mma_block_k, mma_split,
                           mma_warps, mma_stages, r=residual.contiguous(), norm_weight=norm_weight, eps=eps, pdl=pdl)
    if got is not None:
        return got
    tiles = _tiles(block_n, block_k, num_warps)
    max_m = _max_rows(weight, max_m)

    def unfused():
        h, summed = fused_add_rms_norm_triton(x, residual, norm_weight, eps, pdl=pdl)
        return _after_prologue(h, weight, bias, tiles, max_m, pdl, evict), summed

    if x.shape[0] > max_m or x.shape[0] == 0:
        return unfused()
    x, residual = x.contiguous(), residual.contiguous()

    def fused():
        return _gemv(x, weight, bias, ADD_RMS_NORM, tiles, r=residual, norm_weight=norm_weight, eps=eps, pdl=pdl,
                     evict=evict)

    if _auto(x, tiles) and not _triton_is_faster(_key(x, weight, ADD_RMS_NORM), fused, unfused):
        return unfused()
    return fused()


def act_linear_triton(x: torch.Tensor, weight: torch.Tensor, *, max_m: int = 4, block_n: int | None = None,
                      block_k: int | None = None, num_warps: int | None = None, pdl: int = 0, evict: int = 0,
                      mma: int = 0, mma_block_n: int = 0, mma_block_k: int = 0, mma_split: int = 0,
                      mma_warps: int = 0, mma_stages: int = 0, mma_min_numel: int = 0) -> torch.Tensor:
    """x: (T, 2K) holding [gate | up]; weight: (N, K) -> linear(silu(gate) * up). ``evict`` and ``mma*`` as
    ``linear_triton``'s."""
    from kernels.pointwise.activation_triton import silu_and_mul_triton

    assert x.shape[1] == 2 * weight.shape[1], f"input {tuple(x.shape)} does not hold [gate | up] for {tuple(weight.shape)}"
    got = _on_tensor_cores(x, weight, None, SILU_MUL, mma, mma_min_numel, mma_block_n, mma_block_k, mma_split,
                           mma_warps, mma_stages, k=weight.shape[1], pdl=pdl)
    if got is not None:
        return got[0]
    tiles = _tiles(block_n, block_k, num_warps)
    max_m = _max_rows(weight, max_m)
    if x.shape[0] > max_m or x.shape[0] == 0:
        return _matmul(silu_and_mul_triton(x), weight)
    x = x.contiguous()
    def unfused():
        return _after_prologue(silu_and_mul_triton(x), weight, None, tiles, max_m, pdl, evict)

    if _auto(x, tiles) and not _triton_is_faster(
            _key(x, weight, SILU_MUL), lambda: _gemv(x, weight, None, SILU_MUL, tiles, k=weight.shape[1]), unfused):
        return unfused()
    return _gemv(x, weight, None, SILU_MUL, tiles, k=weight.shape[1], pdl=pdl, evict=evict)[0]
