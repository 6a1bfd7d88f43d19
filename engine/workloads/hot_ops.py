"""The workloads' hot ops, each run by torch (the default) or by its fused Triton kernel (kernels/workloads/) while
``hot_ops("triton")`` is active: the FNO's spectral multiply (``spectral_mul``) and message passing's sum at the
destination nodes (``scatter_sum``).

The choice is a context variable, so a variant's forward context (engine/workloads/variants.py) picks the kernels
for the forward it wraps, and nothing outside it changes. The torch path is what the models ran before the
choice existed, operation for operation, so its bits are unchanged.
"""
from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager

import torch

BACKENDS = ("torch", "triton")
SPECTRAL_MUL, SCATTER_SUM = "spectral_mul", "scatter_sum"
OPS = (SPECTRAL_MUL, SCATTER_SUM)  # the hot ops a workload may declare (Workload.hot_ops)

_BACKEND: contextvars.ContextVar[str] = contextvars.ContextVar("workload_hot_ops", default="torch")


def check_backend(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"hot_ops must be one of {BACKENDS}, got {name!r}")
    return name


@contextmanager
def hot_ops(name: str) -> Iterator[None]:
    """Runs the block's hot ops on ``name`` ("torch" or "triton")."""
    token = _BACKEND.set(check_backend(name))
    try:
        yield
    finally:
        _BACKEND.reset(token)


def active() -> str:
    """The backend the hot ops run on here: "torch" outside any ``hot_ops`` block, and always while torch.compile
    traces (dynamo cannot trace a ContextVar read: it would break every compiled graph at each hot op, changing
    the compiled forms' kernels; Triton hot ops run eager, variants.refusal says so)."""
    if torch.compiler.is_compiling():
        return "torch"
    return _BACKEND.get()


def spectral_mul(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """out[b, o, x, y] = sum_i a[b, i, x, y] * w[i, o, x, y] (the FNO paper's einsum "bixy,ioxy->boxy") of complex
    a [B, I, X, Y] and w [I, O, X, Y].

    torch: a broadcast product summed over i, so every output sums its terms in the same order whatever the
    batch and a request's bits do not depend on the requests batched with it (the einsum lowers to a matmul whose
    batch axis is the GEMM's M, and a CPU BLAS picks another kernel, another summation order, for M = 1).
    triton: kernels/workloads/spectral_triton.py, which sums over i in order in float32 (complex64 only)."""
    if active() == "torch":
        return (a.unsqueeze(2) * w.unsqueeze(0)).sum(1)  # [B, I, 1, X, Y] * [1, I, O, X, Y] -> [B, O, X, Y]
    from kernels.workloads.spectral_triton import spectral_mul as triton_spectral_mul

    if a.dtype != torch.complex64 or w.dtype != torch.complex64:
        raise ValueError(f"the Triton spectral multiply takes complex64 operands, got {a.dtype} and {w.dtype}")
    return torch.view_as_complex(triton_spectral_mul(torch.view_as_real(a), torch.view_as_real(w)))


def scatter_sum(msg: torch.Tensor, dst: torch.Tensor, n: int, dim: int = 0) -> torch.Tensor:
    """Sums ``msg``'s slices along ``dim`` (its edge axis, of length E) at the nodes ``dst`` [E] names: the result
    has ``n`` along ``dim`` and ``msg``'s other axes, zeros at nodes without edges.

    torch: zeros, then ``index_add_``. triton: kernels/workloads/segment_triton.py (edges sorted by destination
    once, each node's messages summed in edge order, no atomics), on ``msg`` seen as [B, E, F]."""
    if active() == "torch":
        shape = list(msg.shape)
        shape[dim] = n
        return torch.zeros(shape, dtype=msg.dtype, device=msg.device).index_add_(dim, dst, msg)
    from kernels.workloads.segment_triton import segment_sum

    d = dim % msg.dim()
    last = d == msg.dim() - 1
    x = msg.unsqueeze(-1) if last else msg.movedim(d, -2)  # [..., E, F]
    lead, f = x.shape[:-2], x.shape[-1]
    out = segment_sum(x.reshape(-1, x.shape[-2], f), dst, n)  # [B, n, F]
    out = out.reshape(*lead, n, f)
    return out.squeeze(-1) if last else out.movedim(-2, d)
