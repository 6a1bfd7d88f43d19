"""A deterministic scatter-sum of edge messages at their destination nodes (message passing's aggregation):
out[..., n, f] = sum of msg[..., e, f] over the edges e with dst[e] == n.

torch's ``index_add_`` on a GPU adds by atomics (a different order, so other bits, on every run) unless
deterministic algorithms are on, and then it sorts on every call. Here the edges are sorted by destination once
per call (stable: a node's edges keep their original order), row pointers are read off the sorted destinations
(``searchsorted``, no atomics), and each program sums the incoming messages of a block of consecutive nodes for a
block of features and one batch entry, edge by edge in that order, in float32 (float64 for float64 messages), and
writes the sums in the messages' dtype. No atomics: the same bits on every run, whatever the batch, and for
float32 the bits of a CPU's ``index_add_`` from zeros (which adds in edge order too).

Invariant: a node with no incoming edge gets zeros. On a CUDA device an index outside [0, n) fails an
asynchronous device assert (no host sync, so the call can be captured in a CUDA graph); on the CPU it raises.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

BLOCK_N = 16  # destination nodes per program
MAX_BLOCK_F = 128  # features per program, at most
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class SegmentPlan:
    """The edges grouped by destination: ``order`` [E] int64, the edge ids sorted by destination (stable), and
    ``rowptr`` [n + 1] int64, node k's edges at order[rowptr[k]:rowptr[k + 1]]."""

    order: torch.Tensor
    rowptr: torch.Tensor

    @property
    def nodes(self) -> int:
        return self.rowptr.numel() - 1


def plan_segments(dst: torch.Tensor, n: int) -> SegmentPlan:
    """The plan of ``dst`` [E] (integer node ids in [0, n)) for ``n`` nodes: one stable sort, one searchsorted."""
    if dst.dim() != 1 or dst.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"dst must be a 1-D int64 or int32 tensor of node ids, got {dst.dtype} {list(dst.shape)}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n (the number of nodes) must be a non-negative integer, got {n!r}")
    sorted_dst, order = torch.sort(dst, stable=True)
    bounds = torch.arange(n + 1, device=dst.device, dtype=sorted_dst.dtype)
    rowptr = torch.searchsorted(sorted_dst, bounds)
    inside = rowptr[-1] - rowptr[0]  # edges whose destination lies in [0, n)
    if dst.device.type == "cuda":
        torch._assert_async(inside == dst.numel(), "segment_sum: a destination index lies outside [0, n)")
    elif dst.numel() and int(inside) != dst.numel():
        raise ValueError(f"segment_sum: destination indices must lie in [0, {n}), got min {int(dst.min())} "
                         f"max {int(dst.max())}")
    return SegmentPlan(order, rowptr)


@triton.jit
def _segment_sum_kernel(msg_ptr, order_ptr, rowptr_ptr, out_ptr, N, F, smb, sme, smf, sob, son, sof,
                        ACC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr):
    pid_n, pid_f, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    node = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    f = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    n_in, f_in = node < N, f < F
    start = tl.load(rowptr_ptr + node, mask=n_in, other=0)
    end = tl.load(rowptr_ptr + node + 1, mask=n_in, other=0)
    deg = end - start
    acc = tl.zeros((BLOCK_N, BLOCK_F), dtype=ACC)
    # step k adds the k-th incoming edge of every node of the block: each node adds its own edges in order, and a
    # node past its last edge adds a masked 0.0, which leaves its sum's bits as they are (a sum that starts at +0.0
    # never reaches -0.0 under round-to-nearest). A while loop: Triton's CPU interpreter cannot ``range`` over a
    # computed scalar under numpy 2.4
    most = tl.max(deg, axis=0)
    k = 0
    while k < most:
        live = (k < deg) & n_in
        edge = tl.load(order_ptr + start + k, mask=live, other=0)
        m = tl.load(msg_ptr + b * smb + edge[:, None] * sme + f[None, :] * smf, mask=live[:, None] & f_in[None, :],
                    other=0.0)
        acc += m.to(ACC)
        k += 1
    tl.store(out_ptr + b * sob + node[:, None] * son + f[None, :] * sof, acc.to(out_ptr.dtype.element_ty),
             mask=n_in[:, None] & f_in[None, :])


def _check(msg: torch.Tensor, dst: torch.Tensor) -> None:
    if msg.dim() not in (2, 3):
        raise ValueError(f"segment_sum takes messages [E, F] or [B, E, F], got {list(msg.shape)}")
    if msg.dtype not in DTYPES:
        raise ValueError(f"segment_sum takes floating messages {[str(d) for d in DTYPES]}, got {msg.dtype}")
    if dst.dim() != 1 or dst.shape[0] != msg.shape[-2]:
        raise ValueError(f"dst must be [E] with E = the messages' edge axis ({msg.shape[-2]}), got {list(dst.shape)}")
    if dst.device != msg.device:
        raise ValueError(f"segment_sum: messages on {msg.device} and dst on {dst.device}")


def segment_sum_ref(msg: torch.Tensor, dst: torch.Tensor, n: int) -> torch.Tensor:
    """msg [E, F] or [B, E, F], dst [E] -> [n, F] or [B, n, F]: zeros, then ``index_add_`` along the edge axis."""
    _check(msg, dst)
    return torch.zeros(*msg.shape[:-2], n, msg.shape[-1], dtype=msg.dtype, device=msg.device).index_add_(
        msg.dim() - 2, dst, msg)


def segment_sum(msg: torch.Tensor, dst: torch.Tensor, n: int, plan: SegmentPlan | None = None) -> torch.Tensor:
    """``segment_sum_ref`` in one Triton launch after the plan (module docstring): msg [E, F] or [B, E, F] in any
    strides, dst [E] -> a new contiguous [n, F] or [B, n, F] in msg's dtype. ``plan``: ``plan_segments(dst, n)``
    made beforehand (messages of one graph summed several times sort once)."""
    _check(msg, dst)
    plan = plan or plan_segments(dst, n)
    if plan.nodes != n or plan.order.numel() != dst.numel():
        raise ValueError(f"the plan covers {plan.nodes} nodes and {plan.order.numel()} edges, not {n} and "
                         f"{dst.numel()}")
    m3 = msg if msg.dim() == 3 else msg.unsqueeze(0)  # [B, E, F]
    bsz, _, f = m3.shape
    out = torch.empty(bsz, n, f, dtype=msg.dtype, device=msg.device)
    if out.numel():
        block_f = min(MAX_BLOCK_F, triton.next_power_of_2(f))
        grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(f, block_f), bsz)
        acc = tl.float64 if msg.dtype == torch.float64 else tl.float32
        _segment_sum_kernel[grid](m3, plan.order, plan.rowptr, out, n, f, *m3.stride(), *out.stride(), ACC=acc,
                                  BLOCK_N=BLOCK_N, BLOCK_F=block_f, num_warps=4)
    return out if msg.dim() == 3 else out.squeeze(0)
