"""Generated kernels written from parameterized templates: the offline producer of generated code.

Each template renders one Triton kernel in the generated-kernel grammar (engine/generated/grammar.py) for
one operation; its form (loop order, fusion) is in the source, its tiles in the variant's kernel_params.
``KernelTemplates`` (ops/search/agents.py) proposes them and mutates the best measured: a tile doubled or
halved, another loop order, the activation fused into the projection or not. What it writes goes
through the same checks, smoke run, gates and hot swap as an LLM's kernel source.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.config.variant import VariantSpec
from kernels.generated.launch import MAX_TILE, SIGNATURES

_HEADER = "import triton\nimport triton.language as tl\n\n\n@triton.jit\n"

_NORM = _HEADER + """def {fn}(x_ptr, w_ptr, out_ptr, eps, D: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    ss = tl.zeros([BLOCK_D], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(x_ptr + row * D + cols, mask=cols < D, other=0.0).to(tl.float32)
        ss += x * x
    rstd = tl.rsqrt(tl.sum(ss, axis=0) / D + eps)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(x_ptr + row * D + cols, mask=cols < D, other=0.0)
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0)
        tl.store(out_ptr + row * D + cols, w * (x.to(tl.float32) * rstd).to(x.dtype), mask=cols < D)
"""

_ADD_NORM = _HEADER + """def {fn}(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, eps, D: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    ss = tl.zeros([BLOCK_D], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        s = tl.load(res_ptr + row * D + cols, mask=cols < D, other=0.0) + tl.load(x_ptr + row * D + cols,
                                                                                 mask=cols < D, other=0.0)
        tl.store(sum_ptr + row * D + cols, s, mask=cols < D)
        ss += s.to(tl.float32) * s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(ss, axis=0) / D + eps)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        s = tl.load(sum_ptr + row * D + cols, mask=cols < D, other=0.0)
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0)
        tl.store(out_ptr + row * D + cols, w * (s.to(tl.float32) * rstd).to(s.dtype), mask=cols < D)
"""

_SILU = _HEADER + """def {fn}(x_ptr, out_ptr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    g = tl.load(x_ptr + row * 2 * D + cols, mask=cols < D, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * 2 * D + D + cols, mask=cols < D, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + cols, g * tl.sigmoid(g) * u, mask=cols < D)
"""

# the input tile of a projection: plain, or SiLU(gate) * up computed from the two halves as it is read
_LOAD_PLAIN = "a = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=mk, other=0.0).to(tl.float32)"
_LOAD_ACT = ("g = tl.load(x_ptr + rm[:, None] * (2 * K) + rk[None, :], mask=mk, other=0.0).to(tl.float32)\n"
             "        u = tl.load(x_ptr + rm[:, None] * (2 * K) + K + rk[None, :], mask=mk, other=0.0).to(tl.float32)\n"
             "        a = g * tl.sigmoid(g) * u")

# tiles of rows x columns, the K loop inside: the weights of a K chunk read once for all BLOCK_M rows
_MATMUL_TILE = _HEADER + """def {fn}(x_ptr, w_ptr, out_ptr, M, N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        mk = (rm[:, None] < M) & (rk[None, :] < K)
        {load}
        w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K),
                    other=0.0).to(tl.float32)
        acc += {product}
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))
"""
_PRODUCTS = {"dot": "tl.dot(a, tl.trans(w), input_precision=\"ieee\")",
             "broadcast": "tl.sum(a[:, None, :] * w[None, :, :], axis=2)"}

# one row at a time inside the program, the K loop innermost: weights re-read per row (from cache)
_MATMUL_ROWS = _HEADER + """def {fn}(x_ptr, w_ptr, out_ptr, M, N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    for i in range(0, BLOCK_M):
        m = tl.program_id(0) * BLOCK_M + i
        acc = tl.zeros([BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            {load_row}
            w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K),
                        other=0.0).to(tl.float32)
            acc += tl.sum(w * a[None, :], axis=1)
        tl.store(out_ptr + m * N + rn, acc, mask=(rn < N) & (m < M))
"""
_LOAD_ROW_PLAIN = "a = tl.load(x_ptr + m * K + rk, mask=(rk < K) & (m < M), other=0.0).to(tl.float32)"
_LOAD_ROW_ACT = ("g = tl.load(x_ptr + m * (2 * K) + rk, mask=(rk < K) & (m < M), other=0.0).to(tl.float32)\n"
                 "            u = tl.load(x_ptr + m * (2 * K) + K + rk, mask=(rk < K) & (m < M), other=0.0)"
                 ".to(tl.float32)\n"
                 "            a = g * tl.sigmoid(g) * u")

# form name -> (operations it serves, what it is)
FORMS = {
    "norm_two_pass": (("rms_norm",), "sum of squares over BLOCK_D chunks, then a second pass that normalizes"),
    "add_norm_two_pass": (("fused_add_rms_norm",), "the residual sum written in the first pass, re-read in the "
                                                   "second"),
    "silu_tile": (("silu_and_mul",), "a BLOCK_D slice of one row per program"),
    "matmul_dot": (("linear", "act_linear"), "BLOCK_M x BLOCK_N tiles, tl.dot over BLOCK_K chunks"),
    "matmul_broadcast": (("linear", "act_linear"), "BLOCK_M x BLOCK_N tiles, a broadcast product summed over "
                                                   "BLOCK_K chunks (no tensor cores: small M)"),
    "matmul_rows": (("linear", "act_linear"), "rows one at a time inside the program, the K loop innermost"),
}
DEFAULT_TILES = {
    "norm_two_pass": {"BLOCK_D": 256}, "add_norm_two_pass": {"BLOCK_D": 256}, "silu_tile": {"BLOCK_D": 256},
    "matmul_dot": {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32},
    "matmul_broadcast": {"BLOCK_M": 4, "BLOCK_N": 32, "BLOCK_K": 32},
    "matmul_rows": {"BLOCK_M": 4, "BLOCK_N": 64, "BLOCK_K": 64},
}
MIN_TILE = {"matmul_dot": 16}  # tl.dot needs 16 or more in each dimension


@dataclass(frozen=True)
class KernelChoice:
    """One templated kernel: the operation, the form, its tiles."""

    op: str
    form: str
    tiles: tuple[tuple[str, int], ...]

    @property
    def module(self) -> str:
        return f"tpl_{self.op}_{self.form}"

    def source(self) -> str:
        fn = self.op
        if self.form == "norm_two_pass":
            return _NORM.format(fn=fn)
        if self.form == "add_norm_two_pass":
            return _ADD_NORM.format(fn=fn)
        if self.form == "silu_tile":
            return _SILU.format(fn=fn)
        act = self.op == "act_linear"
        if self.form == "matmul_rows":
            return _MATMUL_ROWS.format(fn=fn, load_row=_LOAD_ROW_ACT if act else _LOAD_ROW_PLAIN)
        product = _PRODUCTS["dot" if self.form == "matmul_dot" else "broadcast"]
        return _MATMUL_TILE.format(fn=fn, load=_LOAD_ACT if act else _LOAD_PLAIN, product=product)

    def apply(self, base: VariantSpec) -> VariantSpec:
        """``base`` with this kernel for its operation (other generated kernels kept)."""
        kernels = {**dict(base.kernels), self.op: f"generated:{self.module}.{self.op}"}
        params = {op: dict(p) for op, p in base.kernel_params}
        params[self.op] = dict(self.tiles)
        source = {**dict(base.generated_source), self.module: self.source()}
        return dataclasses.replace(base, kernels=kernels, kernel_params=params, generated_source=source)

    def describe(self) -> str:
        return f"{self.op}: {self.form} ({', '.join(f'{k} {v}' for k, v in self.tiles)})"


def initial_choices() -> list[KernelChoice]:
    """One choice per operation with a template, at the default tiles of its first form."""
    out = []
    for op in SIGNATURES:
        form = next(f for f, (ops, _) in FORMS.items() if op in ops)
        out.append(KernelChoice(op, form, tuple(sorted(DEFAULT_TILES[form].items()))))
    return out


def choices_in(spec: VariantSpec) -> list[KernelChoice]:
    """The templated kernels a variant holds (recognized by their module names)."""
    out = []
    for op, impl in spec.kernels:
        for form in FORMS:
            if impl == f"generated:tpl_{op}_{form}.{op}":
                out.append(KernelChoice(op, form, tuple(sorted(spec.params(op).items()))))
    return out


def mutations(choice: KernelChoice) -> list[tuple[KernelChoice, str]]:
    """Neighbours of a templated kernel: each tile doubled and halved, and the other forms of its operation
    (another loop order or product)."""
    out = []
    tiles = dict(choice.tiles)
    low = MIN_TILE.get(choice.form, 1)
    for name, value in tiles.items():
        for new in (value * 2, value // 2):
            if low <= new <= MAX_TILE and new != value:
                out.append((dataclasses.replace(choice, tiles=tuple(sorted({**tiles, name: new}.items()))),
                            f"{choice.op}: {name} {value} -> {new}"))
    for form, (ops, what) in FORMS.items():
        if choice.op in ops and form != choice.form:
            out.append((KernelChoice(choice.op, form, tuple(sorted(DEFAULT_TILES[form].items()))),
                        f"{choice.op}: {choice.form} -> {form} ({what})"))
    return out


def fusion_toggles(spec: VariantSpec) -> list[tuple[VariantSpec, str]]:
    """The activation fused into the down projection or not: a variant with a templated ``linear`` and no
    generated ``act_linear`` gets one of the same form and tiles; one with it loses it (then act_linear is
    composed from the variant's silu_and_mul and linear)."""
    held = {c.op: c for c in choices_in(spec)}
    if "act_linear" in held:
        kernels = {op: impl for op, impl in spec.kernels if op != "act_linear"}
        params = {op: dict(p) for op, p in spec.kernel_params if op != "act_linear"}
        source = {m: t for m, t in spec.generated_source if m != held["act_linear"].module}
        return [(dataclasses.replace(spec, kernels=kernels, kernel_params=params, generated_source=source),
                 "act_linear unfused: silu_and_mul, then the projection")]
    if "linear" in held:
        lin = held["linear"]
        return [(KernelChoice("act_linear", lin.form, lin.tiles).apply(spec),
                 f"act_linear fused: SiLU-and-multiply computed as the {lin.form} projection reads its input")]
    return []
