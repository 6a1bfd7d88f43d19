"""The greedy token of each row of a decode step's logits in one launch.

A CUDA graph of the decode step ends with each row's argmax over the vocabulary, written into the next step's
input ids (engine/worker/cuda_graphs.py). torch's ``argmax`` of one 128k-wide row ran one 27.7 us reduction on an H200
at the end of every 8B step (bench/RESULTS.md), about 1% of a batch-1 step in FP8. Here each program takes a
``BLOCK``-wide part of a row and writes the part's largest value and its first index; the row's last program to
arrive (an arrival count, as kernels/linear/qmma_triton.py's split K) picks the largest of the parts, the first one on a
tie, writes the row's token and resets the count, so a replayed graph finds it at zero.

The result is torch's: the first index of the largest value, NaN counting as larger than everything (the first
NaN's index), and 0 for a row of -inf.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _argmax_kernel(x_ptr, out_ptr, val_ptr, idx_ptr, count_ptr, N, stride_x, PARTS: tl.constexpr,
                   PARTS_PAD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    offs = part * BLOCK + tl.arange(0, BLOCK)
    inside = offs < N
    v = tl.load(x_ptr + row * stride_x + offs, mask=inside, other=float("-inf")).to(tl.float32)
    nan = v != v
    first_nan = tl.min(tl.where(nan & inside, offs, N), axis=0)
    v = tl.where(nan, float("-inf"), v)
    best = tl.max(v, axis=0)
    first = tl.min(tl.where((v == best) & inside, offs, N), axis=0)
    has_nan = first_nan < N
    tl.store(val_ptr + row * PARTS + part, tl.where(has_nan, float("nan"), best))
    tl.store(idx_ptr + row * PARTS + part, tl.where(has_nan, first_nan, first))
    tl.debug_barrier()  # the part's result written before the count that publishes it
    arrived = tl.atomic_add(count_ptr + row, 1, sem="acq_rel")
    if arrived == PARTS - 1:
        p = tl.arange(0, PARTS_PAD)
        pm = p < PARTS
        pv = tl.load(val_ptr + row * PARTS + p, mask=pm, other=float("-inf"), cache_modifier=".cg")
        pi = tl.load(idx_ptr + row * PARTS + p, mask=pm, other=N, cache_modifier=".cg")
        pnan = (pv != pv) & pm
        nan_idx = tl.min(tl.where(pnan, pi, N), axis=0)
        pv = tl.where(pnan, float("-inf"), pv)
        top = tl.max(pv, axis=0)
        idx = tl.min(tl.where((pv == top) & pm, pi, N), axis=0)
        idx = tl.where(nan_idx < N, nan_idx, idx)
        tl.store(out_ptr + row, idx.to(out_ptr.dtype.element_ty))
        tl.atomic_xchg(count_ptr + row, 0)


class ArgmaxWorkspace:
    """The parts' values, indices and per-row arrival counts (kept at zero between calls) for up to ``rows`` rows
    of ``n`` logits. A CUDA graph captures these buffers: keep the workspace as long as the graph."""

    def __init__(self, rows: int, n: int, device) -> None:
        self.rows, self.n = rows, n
        self.parts = triton.cdiv(n, BLOCK)
        self.values = torch.empty(rows * self.parts, dtype=torch.float32, device=device)
        self.indices = torch.empty(rows * self.parts, dtype=torch.int32, device=device)
        self.counts = torch.zeros(rows, dtype=torch.int32, device=device)


def argmax_rows(x: torch.Tensor, out: torch.Tensor, work: ArgmaxWorkspace) -> torch.Tensor:
    """Writes each row's argmax of ``x`` (B, N), unit stride along N, into ``out`` (B,) (any integer dtype) and
    returns it."""
    b, n = x.shape
    if b > work.rows or n != work.n:
        raise ValueError(f"argmax workspace holds {work.rows} rows of {work.n}, not {b} of {n}")
    if x.stride(1) != 1 or out.shape != (b,) or (b > 1 and out.stride(0) != 1):
        raise ValueError("argmax_rows needs rows of unit stride and an output of one value per row")
    _argmax_kernel[(b, work.parts)](
        x, out, work.values, work.indices, work.counts, n, x.stride(0), PARTS=work.parts,
        PARTS_PAD=triton.next_power_of_2(work.parts), BLOCK=BLOCK, num_warps=4)
    return out
