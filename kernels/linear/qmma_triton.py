"""Quantized linear on tensor cores for 1-64 rows: one-byte weights against activations quantized per chunk.

The GEMV (kernels/linear/linear_triton.py) converts every one-byte weight to float32 and multiplies it on the CUDA cores;
torch's FP8 GEMM is tiled for many rows and quantizes its input per row in a pass of its own. Here two launches:
the first computes the projection's input (the residual add + RMSNorm, SiLU-and-multiply, or the input as it is)
and quantizes it to the weights' format, one scale per row and ``BLOCK_K`` chunk (absmax / 448 for e4m3, / 127 for
int8: the fine-grained scaling of block-quantized FP8 GEMMs); the second multiplies on the tensor cores, on the
weights as they are stored: each program takes ``BLOCK_N`` weight rows (the MMA's M side: "swap AB", so a batch of
one to a few rows pads only the narrow side of the MMA) and a share of K, and adds each chunk's e4m3 x e4m3 (or
int8 x int8) sums times the chunk's scales; the weights' per-row scales and the bias are applied once at the end.

A tile option (``fused``) does it in one launch: each program computes and quantizes its own chunks of the input
in the MMA loop (the norm's chunks before its 1 / rms: the codes of v and of v / rms are the same, the rows'
sums of squares are gathered in the loop, across the split as well, and 1 / rms is applied to the output). On an
H200 at one row it is the faster for QKV and the output projection (14.2 / 10.0 us against 15.3 / 11.2) and the
slower for gate_up and down (their whole-row activations in shared memory per stage cut the programs per SM);
autotuning times both (bench/RESULTS.md).

Splitting K (``SPLIT_K`` programs per group of weight rows) keeps every SM busy on narrow projections (4,096
outputs are 64 programs of 64 rows): each program writes its float32 partial sums to a workspace and counts
itself in; the last one of a group adds the partials, writes the output and resets the count, in the same launch.

The activations' e4m3 codes are rounded to 3 mantissa bits in float32 before the conversion, so the conversion is
exact and the codes equal torch's round-to-nearest-even (the CPU interpreter's own conversion differs from the
hardware's; kernels/linear/quant_triton.py).

Tiles a variant does not fix come from a table per device and Triton version (kernels/linear/tile_table.py: the
committed ``kernels/linear/tiles/<device>.triton-<x.y>.json`` and the file ``POLYINF_TILE_TABLE`` names), so a
device takes the same tiles in every run; a shape the tables lack is autotuned once per process (and added to that
file). ``tuned_entries`` / ``save_tile_table`` give what this process chose, as a table; the GPU benchmarks write it
to their output folder (``save_autotuned_tiles``).
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch
import triton
import triton.language as tl

from kernels.pointwise.activation_triton import silu_mul
from kernels.timing import graph_time, interpreted as _interpreted
from kernels.pdl import launch_options, pdl_enter
from kernels.linear.quant import FP8_MAX, QuantizedWeight
from kernels.linear.tile_table import TileChoices, TileEntry, TileKey, device_slug

NONE, SILU_MUL, ADD_RMS_NORM = 0, 1, 2  # input prologues: the same codes as kernels/linear/linear_triton.py's
MAX_M = 64  # rows this kernel takes (the MMA's narrow side; wider batches are a GEMM's)
DEFAULT_TILES = {"block_n": 64, "block_k": 256, "split_k": 0, "num_warps": 4, "num_stages": 4, "fused": 0}
# (BLOCK_N, BLOCK_K, warps, stages) tried on a GPU, each with the splits of K that make about each of
# SPLIT_TARGETS programs (``split_for``; a wide projection's 224 programs of whole rows leave a partial second
# round on 132 SMs, and more, shorter programs even it out)
AUTOTUNE_TILES = ((64, 128, 4, 6), (64, 256, 4, 4), (128, 128, 4, 5), (128, 256, 4, 3), (128, 256, 8, 4))
TARGET_PROGRAMS = 264  # two programs per SM of an H200 (132 SMs)
SPLIT_TARGETS = (TARGET_PROGRAMS, 2 * TARGET_PROGRAMS, 4 * TARGET_PROGRAMS)


@triton.jit
def _round_e4m3(v):
    """float32 v (|v| <= 448) rounded to the nearest e4m3 value (ties to even on the normal range): bits of the
    mantissa beyond e4m3's three dropped with the carry; below e4m3's normal range (2^-6), steps of 2^-9 (ties to
    even as well)."""
    bits = v.to(tl.int32, bitcast=True)
    lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lsb) & -1048576).to(tl.float32, bitcast=True)
    av = tl.abs(v)
    sub = ((av * 512.0 + 12582912.0) - 12582912.0) * (1.0 / 512.0)  # 1.5 * 2^23: float32 adds round to even
    sub = tl.where(v < 0, -sub, sub)
    return tl.where(av < 0.015625, sub, normal)


@triton.jit
def _quantize_kernel(x_ptr, r_ptr, nw_ptr, sum_ptr, q_ptr, qs_ptr, stride_x, stride_r, stride_sum, stride_q, eps,
                     K: tl.constexpr, PROLOGUE: tl.constexpr, IS_INT8: tl.constexpr, BLOCK_K: tl.constexpr,
                     PDL: tl.constexpr = 0, K_ALL: tl.constexpr = 1):
    """One program per (row, BLOCK_K chunk): the prologue's output for the chunk, quantized with the chunk's own
    scale (codes to ``q``, the scale to ``qs`` (M, K / BLOCK_K)); the norm's program also writes its chunk of the
    sum (the new residual), after the row's statistics (the row sits in L2)."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    rk = c * BLOCK_K + tl.arange(0, BLOCK_K)
    k_mask = rk < K
    pdl_enter(PDL)
    if PROLOGUE == 1:  # x holds [gate | up], each K wide
        g = tl.load(x_ptr + row * stride_x + rk, mask=k_mask, other=0.0)
        u = tl.load(x_ptr + row * stride_x + K + rk, mask=k_mask, other=0.0)
        a = silu_mul(g, u).to(tl.float32)
    elif PROLOGUE == 2:
        # the row's statistics from one load of the whole row (a loop over its chunks waits for L2 once per
        # chunk: 2.5-4.8 us of a decode step's critical path per layer on an H200, bench/RESULTS.md)
        ok = tl.arange(0, K_ALL)
        v = (tl.load(r_ptr + row * stride_r + ok, mask=ok < K, other=0.0) + tl.load(
            x_ptr + row * stride_x + ok, mask=ok < K, other=0.0)).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(v * v, axis=0) / K + eps)
        s = tl.load(r_ptr + row * stride_r + rk, mask=k_mask, other=0.0) + tl.load(
            x_ptr + row * stride_x + rk, mask=k_mask, other=0.0)
        tl.store(sum_ptr + row * stride_sum + rk, s, mask=k_mask)
        h = (s.to(tl.float32) * rstd).to(s.dtype)  # the norm's output in the checkpoint's dtype
        a = (tl.load(nw_ptr + rk, mask=k_mask, other=0.0) * h).to(tl.float32)
    else:
        a = tl.load(x_ptr + row * stride_x + rk, mask=k_mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(a), axis=0)
    if IS_INT8:
        sa = tl.maximum(amax / 127.0, 1e-12)
        v = a / sa
        q = tl.where(v >= 0, tl.floor(v + 0.5), tl.ceil(v - 0.5))
    else:
        sa = tl.maximum(amax / 448.0, 1e-12)
        q = _round_e4m3(a / sa)
    tl.store(q_ptr + row * stride_q + rk, q.to(q_ptr.dtype.element_ty), mask=k_mask)
    tl.store(qs_ptr + row * ((K + BLOCK_K - 1) // BLOCK_K) + c, sa)


@triton.jit
def _qmma_chunk(acc, ss, w, q_ptr, qs_ptr, x_ptr, r_ptr, nw_ptr, sum_ptr, rm, m_mask, c, stride_q, stride_x, stride_r,
                stride_sum, K: tl.constexpr, CHUNKS: tl.constexpr, IS_INT8: tl.constexpr, BLOCK_K: tl.constexpr,
                FUSED: tl.constexpr, PROLOGUE: tl.constexpr, WRITE_SUM):
    """(acc plus chunk c's product, ss): weight rows ``w`` (BLOCK_N, BLOCK_K) on the tensor cores against the rows'
    codes, times the rows' scales of the chunk. The codes are the quantization launch's, or with ``FUSED`` this
    chunk's prologue output quantized here (the norm's before its 1 / rms: the codes of v and of v / rms are the
    same, and ``ss`` gathers the rows' sums of squares for the scale applied at the end; ``WRITE_SUM``: this
    program also writes the chunk of the residual sum)."""
    rk = c * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = m_mask[:, None] & (rk < K)[None, :]
    if FUSED:
        if PROLOGUE == 1:  # x holds [gate | up], each K wide
            g = tl.load(x_ptr + rm[:, None] * stride_x + rk[None, :], mask=mask, other=0.0)
            u = tl.load(x_ptr + rm[:, None] * stride_x + K + rk[None, :], mask=mask, other=0.0)
            a = silu_mul(g, u).to(tl.float32)
        elif PROLOGUE == 2:
            v = tl.load(r_ptr + rm[:, None] * stride_r + rk[None, :], mask=mask, other=0.0) + tl.load(
                x_ptr + rm[:, None] * stride_x + rk[None, :], mask=mask, other=0.0)
            if WRITE_SUM:
                tl.store(sum_ptr + rm[:, None] * stride_sum + rk[None, :], v, mask=mask)
            v = v.to(tl.float32)
            ss += tl.sum(v * v, axis=1)
            a = tl.load(nw_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)[None, :] * v
        else:
            a = tl.load(x_ptr + rm[:, None] * stride_x + rk[None, :], mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(a), axis=1)
        if IS_INT8:
            sa = tl.maximum(amax / 127.0, 1e-12)
            v = a / sa[:, None]
            codes = tl.where(v >= 0, tl.floor(v + 0.5), tl.ceil(v - 0.5))
        else:
            sa = tl.maximum(amax / 448.0, 1e-12)
            codes = _round_e4m3(a / sa[:, None])
        codes = codes.to(w.dtype)
    else:
        codes = tl.load(q_ptr + rm[:, None] * stride_q + rk[None, :], mask=mask, other=0.0)
        sa = tl.load(qs_ptr + rm * CHUNKS + c, mask=m_mask & (c < CHUNKS), other=0.0)
    if IS_INT8:
        d = tl.dot(w, tl.trans(codes), out_dtype=tl.int32).to(tl.float32)
    else:
        d = tl.dot(w, tl.trans(codes))
    return acc + d * sa[None, :], ss


@triton.jit
def _qmma_kernel(
    q_ptr, qs_ptr, w_ptr, s_ptr, b_ptr, out_ptr, part_ptr, count_ptr, x_ptr, r_ptr, nw_ptr, sum_ptr, M, N, stride_q,
    stride_w, stride_out, stride_x, stride_r, stride_sum, eps, K: tl.constexpr, HAS_BIAS: tl.constexpr,
    IS_INT8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, FUSED: tl.constexpr = 0, PROLOGUE: tl.constexpr = 0, PDL: tl.constexpr = 0,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    n_mask = rn < N
    m_mask = rm < M
    CHUNKS: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    PER_SPLIT: tl.constexpr = (CHUNKS + SPLIT_K - 1) // SPLIT_K
    NORM: tl.constexpr = FUSED and PROLOGUE == 2
    c_first = pid_k * PER_SPLIT
    write_sum = pid_n == 0  # the fused norm: the first group's programs write the residual sum, each its chunks
    # the first chunk of weights is requested before waiting for the launch before (kernels/pdl.py): with PDL this
    # program can be resident while that launch runs, and its weights' latency overlaps it
    rk = c_first * BLOCK_K + tl.arange(0, BLOCK_K)
    w = tl.load(w_ptr + rn[:, None] * stride_w + rk[None, :], mask=n_mask[:, None] & (rk < K)[None, :], other=0.0)
    pdl_enter(PDL)
    acc, ss = _qmma_chunk(tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), tl.zeros([BLOCK_M], dtype=tl.float32), w,
                          q_ptr, qs_ptr, x_ptr, r_ptr, nw_ptr, sum_ptr, rm, m_mask, c_first, stride_q, stride_x,
                          stride_r, stride_sum, K, CHUNKS, IS_INT8, BLOCK_K, FUSED, PROLOGUE, write_sum)
    for i in range(1, PER_SPLIT):  # chunks past K (the last split's) load nothing
        c = c_first + i
        rk = c * BLOCK_K + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rn[:, None] * stride_w + rk[None, :], mask=n_mask[:, None] & (rk < K)[None, :],
                    other=0.0)
        acc, ss = _qmma_chunk(acc, ss, w, q_ptr, qs_ptr, x_ptr, r_ptr, nw_ptr, sum_ptr, rm, m_mask, c, stride_q,
                              stride_x, stride_r, stride_sum, K, CHUNKS, IS_INT8, BLOCK_K, FUSED, PROLOGUE, write_sum)
    acc *= tl.load(s_ptr + rn, mask=n_mask, other=0.0)[:, None]
    out_mask = n_mask[:, None] & m_mask[None, :]
    if SPLIT_K == 1:
        if NORM:
            acc *= tl.rsqrt(ss / K + eps)[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + rm[None, :] * stride_out + rn[:, None], acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # partial sums (SPLIT_K, BLOCK_M, N) float32 (then the fused norm's sums of squares, (groups, SPLIT_K,
        # BLOCK_M)); the group's last program to arrive adds them up
        part = part_ptr + rm[None, :] * N + rn[:, None]
        tl.store(part + pid_k * BLOCK_M * N, acc, mask=out_mask)
        ss_part = part_ptr + SPLIT_K * BLOCK_M * N + pid_n * SPLIT_K * BLOCK_M + rm
        if NORM:
            tl.store(ss_part + pid_k * BLOCK_M, ss)
        tl.debug_barrier()  # every thread's partials written before the count that publishes them
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(part + s * BLOCK_M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
            if NORM:
                ss = tl.zeros([BLOCK_M], dtype=tl.float32)
                for s in range(SPLIT_K):
                    ss += tl.load(ss_part + s * BLOCK_M, cache_modifier=".cg")
                total *= tl.rsqrt(ss / K + eps)[None, :]
            if HAS_BIAS:
                total += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
            tl.store(out_ptr + rm[None, :] * stride_out + rn[:, None], total.to(out_ptr.dtype.element_ty),
                     mask=out_mask)
            tl.atomic_xchg(count_ptr + pid_n, 0)  # ready for the next call (also inside a replayed graph)


def split_for(n: int, k: int, block_n: int, block_k: int, target: int = TARGET_PROGRAMS) -> int:
    """K splits so that about ``target`` programs run (at least two chunks of K per program)."""
    groups = triton.cdiv(n, block_n)
    chunks = triton.cdiv(k, block_k)
    split = 1
    while groups * split * 2 <= target and chunks // (split * 2) >= 2:
        split *= 2
    return split


def candidates(n: int, k: int) -> list[dict]:
    """The tiles autotuning times for an (n, k) weight: each of AUTOTUNE_TILES with each distinct split of
    SPLIT_TARGETS, with the prologue in a launch of its own and fused into the multiply."""
    out = []
    for bn, bk, w, s in AUTOTUNE_TILES:
        for split in dict.fromkeys(split_for(n, k, bn, bk, target) for target in SPLIT_TARGETS):
            for fused in (0, 1):
                out.append({"block_n": bn, "block_k": bk, "split_k": split, "num_warps": w, "num_stages": s,
                            "fused": fused})
    return out


_WORKSPACE: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_RETIRED: list[tuple[torch.Tensor, torch.Tensor]] = []  # outgrown workspaces: graphs captured with them still run


def _workspace(device: torch.device, partials: int, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 partial sums, int32 arrival counts kept at zero between calls) on ``device``, grown as needed.
    Grown outside a graph capture only: the first call of each shape (the warm-up) sizes it; an outgrown one is
    kept, since a CUDA graph captured before may still use it."""
    part, count = _WORKSPACE.get(device, (None, None))
    if part is None or part.numel() < partials or count.numel() < groups:
        if torch.cuda.is_available() and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the split-K workspace must be sized before a graph capture (run the shape once)")
        if part is not None:
            _RETIRED.append((part, count))
        part = torch.empty(max(partials, 1 << 20, 0 if part is None else part.numel()), dtype=torch.float32,
                           device=device)
        count = torch.zeros(max(groups, 4096, 0 if count is None else count.numel()), dtype=torch.int32,
                            device=device)
        _WORKSPACE[device] = (part, count)
    return part, count


def supported(x: torch.Tensor, weight) -> bool:
    """Whether this kernel takes the product: quantized weights, 1-MAX_M rows, on a GPU with int8 / FP8 tensor
    cores (Hopper; FP8 needs compute capability >= 8.9) or under the interpreter."""
    if not isinstance(weight, QuantizedWeight) or not 0 < x.shape[0] <= MAX_M:
        return False
    if _interpreted():
        return True
    if not x.is_cuda:
        return False
    return _capability(x.device.index if x.device.index is not None else torch.cuda.current_device()) >= (
        (8, 9) if weight.kind == "fp8" else (8, 0))


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


@functools.cache
def _device_name(device_index: int) -> str:
    return torch.cuda.get_device_name(device_index)


_TUNED = TileChoices()  # this process's tiles per (device name, TileKey): from the device's table or autotuned


def _launch(x, weight: QuantizedWeight, bias, prologue, tiles: dict, r=None, norm_weight=None, eps=0.0, k=None,
            pdl=0):
    m, n = x.shape[0], weight.q.shape[0]
    k = weight.q.shape[1] if k is None else k
    assert weight.q.stride(1) == 1 and x.stride(1) == 1, "rows must be contiguous"
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    summed = torch.empty(m, k, device=x.device, dtype=x.dtype) if prologue == ADD_RMS_NORM else out
    r = x if r is None else r
    norm_weight = weight.q if norm_weight is None else norm_weight
    block_m = max(16, triton.next_power_of_2(m))
    t = {**DEFAULT_TILES, **tiles}
    split = t["split_k"] or split_for(n, k, t["block_n"], t["block_k"])
    groups = triton.cdiv(n, t["block_n"])
    fused = int(bool(t["fused"]))
    part, count = _workspace(x.device, split * block_m * (n + groups) if split > 1 else 0, groups)
    pdl_opts = launch_options(pdl, x)
    if fused:  # the prologue and the quantization inside the multiply: no codes in between
        q, qs = weight.q, weight.scale  # not read
    else:
        chunks = triton.cdiv(k, t["block_k"])
        q = torch.empty(m, k, device=x.device, dtype=weight.q.dtype)  # rows up to BLOCK_M are masked, never read
        qs = torch.empty(m, chunks, device=x.device, dtype=torch.float32)
        _quantize_kernel[(m, chunks)](
            x, r, norm_weight, summed, q, qs, x.stride(0), r.stride(0), summed.stride(0), q.stride(0), eps, K=k,
            PROLOGUE=prologue, IS_INT8=weight.kind == "int8", BLOCK_K=t["block_k"], num_warps=4,
            K_ALL=triton.next_power_of_2(k) if prologue == ADD_RMS_NORM else 1, **pdl_opts)
    _qmma_kernel[(groups, split)](
        q, qs, weight.q, weight.scale, weight.scale if bias is None else bias, out, part, count, x, r, norm_weight,
        summed, m, n, q.stride(0), weight.q.stride(0), out.stride(0), x.stride(0), r.stride(0), summed.stride(0), eps,
        K=k, HAS_BIAS=bias is not None, IS_INT8=weight.kind == "int8", BLOCK_M=block_m, BLOCK_N=t["block_n"],
        BLOCK_K=t["block_k"], SPLIT_K=split, FUSED=fused, PROLOGUE=prologue if fused else 0,
        num_warps=t["num_warps"], num_stages=t["num_stages"], **pdl_opts)
    return out, (summed if prologue == ADD_RMS_NORM else None)


def qmma(x, weight: QuantizedWeight, bias=None, prologue: int = NONE, tiles: dict | None = None, r=None,
         norm_weight=None, eps: float = 0.0, k: int | None = None, pdl: int = 0):
    """(out, summed or None) for x's rows (the prologue's input, as kernels/linear/linear_triton.py's ``_gemv``). ``tiles``
    (block_n, block_k, split_k, num_warps, num_stages) fixed by a variant; none on a GPU: the device's table's for
    this shape, else the best of ``candidates``, timed once (L2 flushed: a decode step streams its weights) at the
    call's ``pdl`` level, as the step launches them (the multiply's first weights requested while the quantization
    runs). The key leaves ``pdl`` out: a shape's first call decides."""
    tiles = dict(tiles or {})
    if not tiles and x.is_cuda and not _interpreted():
        key = TileKey(max(16, triton.next_power_of_2(x.shape[0])), *weight.q.shape, weight.kind, prologue)
        index = x.device.index if x.device.index is not None else torch.cuda.current_device()
        tiles = _TUNED.choose(_device_name(index), key, lambda: _autotune(
            key, x, weight, bias, prologue, r, norm_weight, eps, k, pdl)).tiles
    return _launch(x, weight, bias, prologue, tiles, r, norm_weight, eps, k, pdl)


def _autotune(key: TileKey, x, weight: QuantizedWeight, bias, prologue: int, r, norm_weight, eps: float,
              k: int | None, pdl: int) -> TileEntry:
    """The fastest of ``candidates`` for this call's shape, timed at its ``pdl`` level."""
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("qmma tiles are chosen before a graph capture (run the shape once)")
    best = None
    for trial in candidates(weight.q.shape[0], weight.q.shape[1] if k is None else k):
        try:
            ms = graph_time(lambda: _launch(x, weight, bias, prologue, trial, r, norm_weight, eps, k, pdl))
        except Exception:  # a tile the device cannot hold (shared memory): not a candidate
            continue
        if best is None or ms < best[0]:
            best = (ms, trial)
    if best is None:
        raise RuntimeError(f"no qmma tile runs for {tuple(weight.q.shape)} on {x.device}")
    return TileEntry(key, best[1], best[0], pdl)


def _current_device_name() -> str:
    return _device_name(torch.cuda.current_device())


def tuned_entries(device_name: str | None = None) -> dict:
    """The tiles this process autotuned or read from a table on devices named ``device_name`` (the current CUDA
    device's by default), as a tile table's JSON object (kernels/linear/tile_table.py)."""
    return _TUNED.to_json(device_name or _current_device_name())


def save_tile_table(path, device_name: str | None = None) -> Path:
    """``tuned_entries(device_name)`` written to ``path`` (atomically; entries the file holds for other shapes
    stay)."""
    return _TUNED.save(Path(path), device_name or _current_device_name())


def save_autotuned_tiles(folder) -> list[Path]:
    """If this process autotuned any shape on a GPU: its table written to ``folder``/tile-table.json (one file
    per device name, ``tile-table.<slug>.json``, if it used GPUs of several names); the files written. Touches
    no GPU when nothing was autotuned."""
    names = _TUNED.autotuned_devices()
    return [save_tile_table(Path(folder) / ("tile-table.json" if len(names) == 1 else
                                            f"tile-table.{device_slug(name)}.json"), name) for name in names]


def qmma_ref(x: torch.Tensor, weight: QuantizedWeight, block_k: int, bias: torch.Tensor | None = None,
             row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch, float64: what the kernel computes for input x (T, K) (after its prologue): each row's
    ``block_k`` chunks quantized to the weight's format with their own scale, times the quantized weights, times
    the weights' scales (and ``row_scale`` (T,), before the bias: the fused norm's 1 / rms, ``fused_norm_ref``)."""
    t, k = x.shape
    out = torch.zeros(t, weight.q.shape[0], dtype=torch.float64, device=x.device)
    wq = weight.q.to(torch.float64)
    for k0 in range(0, k, block_k):
        a = x[:, k0:k0 + block_k].to(torch.float32)  # the scales and codes in float32, as the kernel computes them
        amax = a.abs().amax(dim=1, keepdim=True)
        if weight.kind == "int8":
            sa = (amax / 127.0).clamp(min=1e-12)
            v = a / sa
            aq = torch.where(v >= 0, torch.floor(v + 0.5), torch.ceil(v - 0.5))
        else:
            sa = (amax / FP8_MAX).clamp(min=1e-12)
            aq = (a / sa).to(torch.float8_e4m3fn)
        out += (aq.to(torch.float64) @ wq[:, k0:k0 + block_k].t()) * sa.to(torch.float64)
    out *= weight.scale.to(torch.float64)[None, :]
    if row_scale is not None:
        out *= row_scale.to(torch.float64)[:, None]
    return out if bias is None else out + bias.to(torch.float64)


def fused_norm_ref(x: torch.Tensor, r: torch.Tensor, norm_weight: torch.Tensor, eps: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain torch: (the input the fused norm quantizes, float32: the norm's weight times the residual sum, before
    1 / rms; 1 / rms per row, float64; the residual sum in x's dtype) for ``qmma_ref(..., row_scale=)``."""
    s = x + r
    v = s.to(torch.float32)
    rstd = torch.rsqrt(v.double().pow(2).mean(dim=1) + eps)
    return norm_weight.to(torch.float32)[None, :] * v, rstd, s
