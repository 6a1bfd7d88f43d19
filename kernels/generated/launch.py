"""Launchers for generated Triton kernels: each operation's fixed kernel signature, and the bounded views
the launcher hands a kernel.

A generated kernel is one ``@triton.jit`` function (engine/generated/grammar.py says what it may contain).
It never sees the engine's state: its launcher takes the operation's arguments (same signature as the
reference in kernels/), makes contiguous copies or views of just those tensors, allocates the outputs,
and launches the kernel over a fixed grid. Every pointer parameter arrives with its element count
(``_n_<name>``, appended by the grammar's rewrite, which masks every load and store to it), so a kernel
can read only its own inputs and write only its own outputs. Model dimensions are ``tl.constexpr``
(fixed per model, so every loop's trip count is known when the kernel is smoke-run at the served
shapes); the number of rows is a runtime value that only sizes the grid.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kernels.pointwise.activation import silu_and_mul_ref
from kernels.linear.linear import act_linear_ref, linear_ref
from kernels.pointwise.norm import fused_add_rms_norm_ref, rms_norm_ref

MAX_TILE = 1024  # largest tile a variant may give a generated kernel (per dimension)
NUM_WARPS = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class KernelSignature:
    op: str
    params: tuple[str, ...]  # the kernel's parameters, in order
    inputs: tuple[str, ...]  # pointers the kernel may read
    outputs: tuple[str, ...]  # pointers the kernel may read and write
    constexprs: tuple[str, ...]  # parameters annotated tl.constexpr: model dimensions and tiles
    tiles: dict  # tile parameter -> default (a function of the launch's dims)
    grid: str  # how many programs run, for the agents' prompt
    doc: str  # what each parameter holds, for the agents' prompt

    @property
    def pointers(self) -> tuple[str, ...]:
        return tuple(p for p in self.params if p in self.inputs or p in self.outputs)


def _pow2(n: int, cap: int = MAX_TILE) -> int:
    return min(cap, 1 << max(0, int(n) - 1).bit_length())


SIGNATURES = {
    "rms_norm": KernelSignature(
        "rms_norm", ("x_ptr", "w_ptr", "out_ptr", "eps", "D", "BLOCK_D"), ("x_ptr", "w_ptr"), ("out_ptr",),
        ("D", "BLOCK_D"), {"BLOCK_D": lambda d: _pow2(d["D"])}, "(rows,): one program per row",
        "x_ptr: (rows, D) input; w_ptr: (D,) weight; out_ptr: (rows, D) output, x's dtype; eps: float; "
        "out = w * (x / sqrt(mean(x^2) + eps)), the statistics in float32"),
    "fused_add_rms_norm": KernelSignature(
        "fused_add_rms_norm", ("x_ptr", "res_ptr", "w_ptr", "out_ptr", "sum_ptr", "eps", "D", "BLOCK_D"),
        ("x_ptr", "res_ptr", "w_ptr"), ("out_ptr", "sum_ptr"), ("D", "BLOCK_D"),
        {"BLOCK_D": lambda d: _pow2(d["D"])}, "(rows,): one program per row",
        "x_ptr, res_ptr: (rows, D); w_ptr: (D,); sum_ptr: (rows, D) output x + res; out_ptr: (rows, D) output "
        "rms_norm(x + res) * w, the statistics in float32"),
    "silu_and_mul": KernelSignature(
        "silu_and_mul", ("x_ptr", "out_ptr", "D", "BLOCK_D"), ("x_ptr",), ("out_ptr",), ("D", "BLOCK_D"),
        {"BLOCK_D": lambda d: _pow2(d["D"], 256)}, "(rows, cdiv(D, BLOCK_D))",
        "x_ptr: (rows, 2 * D) holding [gate | up]; out_ptr: (rows, D) output silu(gate) * up"),
    "linear": KernelSignature(
        "linear", ("x_ptr", "w_ptr", "out_ptr", "M", "N", "K", "BLOCK_M", "BLOCK_N", "BLOCK_K"),
        ("x_ptr", "w_ptr"), ("out_ptr",), ("N", "K", "BLOCK_M", "BLOCK_N", "BLOCK_K"),
        {"BLOCK_M": lambda d: 16, "BLOCK_N": lambda d: 32, "BLOCK_K": lambda d: 64},
        "(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))",
        "x_ptr: (M, K) input rows; w_ptr: (N, K) weight; out_ptr: (M, N) output x @ w^T in x's dtype "
        "(the launcher adds the bias); M is a runtime value, N and K are tl.constexpr"),
    "act_linear": KernelSignature(
        "act_linear", ("x_ptr", "w_ptr", "out_ptr", "M", "N", "K", "BLOCK_M", "BLOCK_N", "BLOCK_K"),
        ("x_ptr", "w_ptr"), ("out_ptr",), ("N", "K", "BLOCK_M", "BLOCK_N", "BLOCK_K"),
        {"BLOCK_M": lambda d: 16, "BLOCK_N": lambda d: 32, "BLOCK_K": lambda d: 64},
        "(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))",
        "x_ptr: (M, 2 * K) holding [gate | up]; w_ptr: (N, K); out_ptr: (M, N) output "
        "(silu(gate) * up) @ w^T in x's dtype; M is a runtime value, N and K are tl.constexpr"),
}
GENERATED_OPS = tuple(SIGNATURES)
REFERENCES = {"rms_norm": rms_norm_ref, "fused_add_rms_norm": fused_add_rms_norm_ref, "silu_and_mul": silu_and_mul_ref,
              "linear": linear_ref, "act_linear": act_linear_ref}


def check_tiles(op: str, params: dict) -> dict:
    """The variant's kernel parameters for a generated ``op``, checked: tile names of its signature (powers of
    two up to MAX_TILE) and ``num_warps``. Raises ValueError naming the first bad one."""
    sig = SIGNATURES[op]
    for name, value in params.items():
        if name == "num_warps":
            if value not in NUM_WARPS:
                raise ValueError(f"num_warps must be one of {NUM_WARPS}, got {value!r}")
        elif name not in sig.tiles:
            raise ValueError(f"unknown parameter {name!r} for a generated {op} kernel; tiles: {', '.join(sig.tiles)}")
        elif not isinstance(value, int) or isinstance(value, bool) or value < 1 or value > MAX_TILE \
                or value & (value - 1):
            raise ValueError(f"{name} must be a power of two from 1 to {MAX_TILE}, got {value!r}")
    return dict(params)


def _launch(kernel, op: str, grid: tuple[int, ...], tensors: dict, scalars: dict, dims: dict, params: dict) -> None:
    """Launches ``kernel`` with the op's parameters in order, each pointer's element count after them."""
    sig = SIGNATURES[op]
    values = {**tensors, **scalars, **dims}
    for name, default in sig.tiles.items():
        values[name] = params.get(name, default(dims))
    args = [values[p] for p in sig.params] + [tensors[p].numel() for p in sig.pointers]
    kernel[grid](*args, num_warps=params.get("num_warps", 4))


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _tile(op: str, params: dict, name: str, dims: dict) -> int:
    return params.get(name, SIGNATURES[op].tiles[name](dims))


def make_launcher(op: str, kernel, params: dict) -> Callable:
    """The operation ``op`` (its reference's signature) running the generated ``kernel`` with ``params``."""
    params = check_tiles(op, params)

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        d = x.shape[-1]
        if weight.shape != (d,):
            raise ValueError(f"weight {tuple(weight.shape)} does not match the last dim {d}")
        xr = _rows(x)
        out = torch.empty_like(xr)
        if xr.shape[0]:
            _launch(kernel, op, (xr.shape[0],), {"x_ptr": xr, "w_ptr": weight.contiguous(), "out_ptr": out},
                    {"eps": float(eps)}, {"D": d}, params)
        return out.view(x.shape)

    def fused_add_rms_norm(x, residual, weight, eps):
        d = x.shape[-1]
        if residual.shape != x.shape or weight.shape != (d,):
            raise ValueError(f"x {tuple(x.shape)}, residual {tuple(residual.shape)}, weight {tuple(weight.shape)}")
        xr, rr = _rows(x), _rows(residual)
        out, summed = torch.empty_like(xr), torch.empty_like(xr)
        if xr.shape[0]:
            _launch(kernel, op, (xr.shape[0],), {"x_ptr": xr, "res_ptr": rr, "w_ptr": weight.contiguous(),
                                                 "out_ptr": out, "sum_ptr": summed}, {"eps": float(eps)}, {"D": d},
                    params)
        return out.view(x.shape), summed.view(x.shape)

    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        xr = _rows(x)
        out = torch.empty(xr.shape[0], d, dtype=x.dtype, device=x.device)
        if xr.shape[0]:
            dims = {"D": d}
            _launch(kernel, op, (xr.shape[0], _cdiv(d, _tile(op, params, "BLOCK_D", dims))),
                    {"x_ptr": xr, "out_ptr": out}, {}, dims, params)
        return out.view(*x.shape[:-1], d)

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return _matmul(x, weight, bias, x.shape[-1])

    def act_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return _matmul(x, weight, None, x.shape[-1] // 2)

    def _matmul(x, weight, bias, k):
        n = weight.shape[0]
        if weight.shape != (n, k):
            raise ValueError(f"weight {tuple(weight.shape)} does not match the input's {k} columns")
        xr = _rows(x)
        m = xr.shape[0]
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        if m:
            dims = {"N": n, "K": k}
            grid = (_cdiv(m, _tile(op, params, "BLOCK_M", dims)), _cdiv(n, _tile(op, params, "BLOCK_N", dims)))
            _launch(kernel, op, grid, {"x_ptr": xr, "w_ptr": weight.contiguous(), "out_ptr": out}, {"M": m}, dims,
                    params)
        if bias is not None:
            out += bias
        return out.view(*x.shape[:-1], n)

    return {"rms_norm": rms_norm, "fused_add_rms_norm": fused_add_rms_norm, "silu_and_mul": silu_and_mul,
            "linear": linear, "act_linear": act_linear}[op]


def smoke_cases(op: str, dims: dict | None, generator: torch.Generator, device: str = "cpu",
                dtype: torch.dtype = torch.float32) -> list[tuple]:
    """Argument tuples for ``op``: small odd shapes, then (with the model's ``dims``: hidden, intermediate,
    and the projections' (N, K) pairs) every shape it serves, one row each, so every loop runs the trip
    counts it will run in the engine. Random values are drawn on ``device`` (``generator``'s device)."""
    def r(*shape):
        return torch.randn(*shape, generator=generator, device=generator.device).to(device=device, dtype=dtype)

    cases = []
    if op == "rms_norm":
        cases = [(r(5, 24), r(24), 1e-6), (r(3, 100), r(100), 1e-5)]
        if dims:
            cases.append((r(4, dims["hidden"]), r(dims["hidden"]), 1e-6))
    elif op == "fused_add_rms_norm":
        cases = [(r(5, 24), r(5, 24), r(24), 1e-6), (r(2, 100), r(2, 100), r(100), 1e-5)]
        if dims:
            h = dims["hidden"]
            cases.append((r(4, h), r(4, h), r(h), 1e-6))
    elif op == "silu_and_mul":
        cases = [(r(4, 40),), (r(3, 300),)]
        if dims:
            cases.append((r(4, 2 * dims["intermediate"]),))
    elif op in ("linear", "act_linear"):
        width = 2 if op == "act_linear" else 1
        cases = [(r(3, 24 * width), r(10, 24)), (r(17, 70 * width), r(33, 70))]
        if op == "linear":
            cases[1] = cases[1] + (r(33),)
        if dims:
            pairs = dims["projections"] if op == "linear" else [(dims["hidden"], dims["intermediate"])]
            cases += [(r(1, k * width), r(n, k)) for n, k in sorted({tuple(p) for p in pairs})]
    return cases
