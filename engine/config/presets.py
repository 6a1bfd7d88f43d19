"""Named presets: the forward-pass forms the benchmarks validated, each a kernel table and its parameters.

A preset is data (``Preset``); ``preset_variant(name, hidden_size, **knobs)`` turns one into a VariantSpec.
Its ``measured`` field says where it was measured (the dated notes of bench/results/). The GPU benchmark
(bench/gpu/) takes its forms from here by name, so a finding is written down once.

The kernel groups the presets are made of (``TRITON_ALL``, ``TRITON_GEMV``, ``TRITON_MOE_DECODE``) and the
parameter helpers (``with_pdl``, ``moe_decode_params``) are public: ``KernelChoices`` (ops/search/agents.py) and the
gates script (bench/gpu/gates.py) compose their forms from them.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Mapping

from engine.errors import ConfigError
from engine.config.variant import VariantSpec

# every operation on its built-in Triton kernel, and apart from them the decode projections' matrix-vector
# kernels (with the norm and the activation fused into their input)
TRITON_ALL = {"rms_norm": "triton", "fused_add_rms_norm": "triton", "rotary": "triton", "silu_and_mul": "triton",
              "store_kv": "triton", "rotary_store_kv": "triton", "norm_rotary_store_kv": "triton",
              "attention": "triton_paged", "moe": "triton"}
TRITON_GEMV = {"linear": "triton", "norm_linear": "triton", "act_linear": "triton"}
# the operations whose Triton kernels take ``pdl``: programmatic dependent launch on Hopper and later
# (kernels/pdl.py), each kernel of a decode step scheduled while the one before it finishes
PDL_OPS = ("rms_norm", "fused_add_rms_norm", "rotary_store_kv", "norm_rotary_store_kv", "attention", "rotary_attention",
           "moe", "linear", "norm_linear", "act_linear", "norm_moe")
# the batch-1 MoE decode form measured best on an H200 (bench/RESULTS.md): the attention block (q/k norms,
# rotary, KV store, split-KV attention) in one launch, the output projection read into L2 while it runs,
# besides every Triton kernel
TRITON_MOE_DECODE = {**TRITON_ALL, **TRITON_GEMV, "prefetch": "triton", "rotary_attention": "triton"}

# decode attention tiles: paged, 128 keys per tile and 8 warps (best before split-KV); split-KV, the number of
# splits from the batch size, 32 keys per tile
PAGED_ATTENTION = {"block_n": 128, "num_warps": 8}
SPLIT_KV_ATTENTION = {"num_splits": 0, "block_n": 32}
# the parameters moe_decode_params sets to a whole row of the model's hidden size: (op, parameter)
WHOLE_ROW = (("linear", "block_k"), ("norm_linear", "block_k"), ("moe", "decode_block_k"))


LONG_CONTEXT = 4096  # tokens: from here split-KV attention's splits follow the context (context_splits)


def context_splits(context: float) -> int:
    """Split-KV attention's ``num_splits`` for decode at ``context`` tokens: the power of two nearest one split per
    2,048 tokens, 8 to 32.
    The automatic count (0) sizes the splits for short contexts by the batch alone: at 32,000 tokens and batch 1
    it read the cache at a quarter of the roofline, and 16 splits decoded 2.37x faster (H200, bench/RESULTS.md)."""
    return int(min(32, max(8, 2 ** round(math.log2(max(context, 1.0) / 2048)))))


def with_pdl(kernel_params: dict | None = None, level: int = 1) -> dict:
    """``kernel_params`` (op -> params) with ``pdl=level`` added for every operation in PDL_OPS."""
    params = {op: dict(p) for op, p in dict(kernel_params or {}).items()}
    for op in PDL_OPS:
        params.setdefault(op, {})["pdl"] = level
    return params


def launched(spec: VariantSpec, level: int) -> VariantSpec:
    """``spec`` named ", pdl ``level``" with every operation in PDL_OPS at dependent-launch ``level`` (0: off)."""
    return dataclasses.replace(spec, name=f"{spec.name}, pdl {level}",
                               kernel_params=with_pdl(dict(spec.kernel_params), level))


def whole_row(hidden_size: int) -> int:
    """A tile over a whole row of ``hidden_size`` columns: its power of two, up to 2,048 (all requested before
    the dependent launch's wait)."""
    return min(2048, 1 << max(0, hidden_size - 1).bit_length())


def _moe_decode_params(attention: dict) -> dict:
    """moe_decode_params without the whole-row tiles (WHOLE_ROW): the preset's data."""
    rows = {"block_n": 4, "num_warps": 4, "evict": 1}
    moe = {"decode_split_down": 2, "decode_block_n": 2, "decode_warps": 4, "decode_down_block_n": 16,
           "decode_down_block_k": 256, "decode_evict": 1, "decode_act": 1}
    return {**with_pdl({"attention": attention, "rotary_attention": {**attention, "merge_by_last": 0}, "moe": moe,
                        "linear": rows, "norm_linear": rows}, 2),
            "prefetch": {"defer_join": 1, "next_qkv": 2}}


def _sized(kernel_params: Mapping, sized: tuple[tuple[str, str], ...], hidden_size: int | None) -> dict:
    """A copy of ``kernel_params`` with each (op, parameter) of ``sized`` set to ``whole_row(hidden_size)``."""
    params = {op: dict(p) for op, p in kernel_params.items()}
    if sized:
        if not isinstance(hidden_size, int) or isinstance(hidden_size, bool) or hidden_size < 1:
            raise ConfigError(f"this preset's tiles span a whole row: it needs the model's hidden size, got "
                              f"{hidden_size!r}")
        for op, name in sized:
            params.setdefault(op, {})[name] = whole_row(hidden_size)
    return params


def moe_decode_params(attention: dict, hidden_size: int) -> dict:
    """TRITON_MOE_DECODE's kernel parameters: the next kernel scheduled before the wait (pdl 2); projection
    tiles of a whole row (up to 2,048 columns: all requested before the wait), and the experts' gate/up the
    same, each program 2 gate and the matching 2 up rows, writing their activation; the down projection 16 rows
    per program with the experts' sum in it, the experts' weights read evict-first (streamed through L2 once),
    the projections' too; the attention block's splits merged by the merge kernel after it; during the attention
    the output projection and then the next layer's QKV projection read into L2 on a side stream, joined once at
    the step's end (a wait before a kernel would cost it its dependent launch)."""
    return _sized(_moe_decode_params(attention), WHOLE_ROW, hidden_size)


@dataclass(frozen=True)
class Preset:
    """One validated forward-pass form."""

    name: str  # the key in PRESETS
    what: str  # the form, in words
    kernels: Mapping[str, str]  # op -> implementation, as VariantSpec.kernels
    kernel_params: Mapping[str, Mapping[str, int]]  # op -> {param: value}, as VariantSpec.kernel_params
    measured: str  # where it was measured (best, or against what it lost): bench/results/ note and figure
    # (op, parameter) pairs set to a whole row of the model (``whole_row(hidden_size)``) when the spec is built
    whole_row: tuple[tuple[str, str], ...] = ()

    def params(self, hidden_size: int | None = None) -> dict:
        """The kernel parameters for a model of ``hidden_size`` (needed only by presets with whole-row tiles)."""
        return _sized(self.kernel_params, self.whole_row, hidden_size)


_B, _D = "bench/results/2026-11-30-h200-bench.md", "bench/results/2026-11-30-h200-decode.md"
_M, _M2 = "bench/results/2026-11-30-h200-moe-decode.md", "bench/results/2026-12-01-h200-moe-decode.md"
_PRESETS = (
    Preset("triton", "every operation on its built-in Triton kernel (fused rotary + KV store, paged attention), "
           "default tiles", TRITON_ALL, {},
           f"{_B} (decode run ahead): 8B decode b=1, eager, ahead, 76.3 tok/s; the gates pass with it on both "
           "model shapes"),
    Preset("triton-paged", "every Triton kernel, paged decode attention in 128-key tiles with 8 warps",
           TRITON_ALL, {"attention": PAGED_ATTENTION},
           f"{_B} (decode run ahead): 8B decode b=1 with CUDA graphs, ahead, 214.9 tok/s = 80.9% of the roofline "
           "(best then); 8B offline throughput 14.75x transformers' eager batched generate"),
    Preset("gemv-linear", "triton-paged, and the decode projections as Triton matrix-vector kernels (per shape "
           "against cuBLAS)", {**TRITON_ALL, "linear": "triton"}, {"attention": PAGED_ATTENTION},
           f"{_D} (decode projections as GEMV): 8B decode b=1, 227.8 tok/s = 86.3%"),
    Preset("gemv-linear-act", "gemv-linear with SiLU-and-multiply fused into the down projection",
           {**TRITON_ALL, "linear": "triton", "act_linear": "triton"}, {"attention": PAGED_ATTENTION},
           f"{_D} (decode projections as GEMV): 8B decode b=1, 229.9 tok/s = 87.1% (best then)"),
    Preset("gemv", "gemv-linear-act with the residual add + RMSNorm fused into the projections too (each fused "
           "kernel per shape against its unfused path)", {**TRITON_ALL, **TRITON_GEMV}, {"attention": PAGED_ATTENTION},
           f"{_D}: 8B decode b=1, 227.3 tok/s (decode projections as GEMV), 226.0 tok/s = 85.1% (split-KV)"),
    Preset("gemv-split-kv", "gemv with split-KV decode attention (the splits from the batch size)",
           {**TRITON_ALL, **TRITON_GEMV}, {"attention": SPLIT_KV_ATTENTION},
           f"{_D} (split-KV): 8B decode b=1, 227.3 tok/s = 85.6% (best then); {_M}: the MoE decode's \"previous "
           "best (no dependent launch)\" rows, 47-48% of the active roofline"),
    Preset("gemv-split-kv-pdl", "gemv-split-kv with programmatic dependent launch (pdl 1: wait, then schedule "
           "the next kernel)", {**TRITON_ALL, **TRITON_GEMV}, with_pdl({"attention": SPLIT_KV_ATTENTION}),
           f"{_M} (dependent launch): 8B decode b=1, 228.4 tok/s = 86.5% (best then); the gates pass with it on "
           "the 8B shape, 32 layers"),
    Preset("gemv-split-kv-pdl-prefetch", "gemv-split-kv-pdl with the output projection read into L2 during the "
           "attention", {**TRITON_ALL, **TRITON_GEMV, "prefetch": "triton"},
           with_pdl({"attention": SPLIT_KV_ATTENTION}),
           f"{_M} (dependent launch): 8B decode b=1, 212.7 tok/s = 80.6%, slower than without the prefetch; "
           f"{_M2}: 210.8 tok/s"),
    Preset("dense-decode", "gemv-split-kv-pdl with the attention block (rotary, KV store, split-KV attention, "
           "merge) in one launch, its first cache tile requested before the wait: what KernelChoices proposes "
           "for dense models at low concurrency", {**TRITON_ALL, **TRITON_GEMV, "rotary_attention": "triton"},
           with_pdl({"attention": SPLIT_KV_ATTENTION, "rotary_attention": SPLIT_KV_ATTENTION}),
           f"{_M} (the 8B with the attention block in one launch): 8B decode b=1, 223.7 tok/s = 84.3% (best); "
           f"{_M2}: 222.1 tok/s = 83.7% (best)"),
    Preset("dense-decode-evict", "dense-decode with the projections' weights read evict-first and the output "
           "projection read into L2 during the attention, its join at the step's end",
           {**TRITON_ALL, **TRITON_GEMV, "rotary_attention": "triton", "prefetch": "triton"},
           {**with_pdl({"attention": SPLIT_KV_ATTENTION, "rotary_attention": SPLIT_KV_ATTENTION,
                        **{op: {"evict": 1} for op in ("linear", "norm_linear", "act_linear")}}),
            "prefetch": {"defer_join": 1}},
           f"{_M2}: 8B decode b=1, 219.5 tok/s = 82.8%, 1.2% slower than dense-decode"),
    Preset("moe-decode-two-launch-attention", "moe-decode with the attention block in two launches (rotary + "
           "KV store, then split-KV attention)", {**TRITON_ALL, **TRITON_GEMV, "prefetch": "triton"},
           _moe_decode_params(SPLIT_KV_ATTENTION),
           f"{_M} (the 8B with the attention block in one launch): 8B decode b=1, 215.4 tok/s = 81.2% against "
           f"216.0 in one launch; {_M2}: 191.3 tok/s", WHOLE_ROW),
    Preset("moe-decode", "TRITON_MOE_DECODE with moe_decode_params: what KernelChoices proposes for "
           "mixture-of-experts models at low concurrency", TRITON_MOE_DECODE, _moe_decode_params(SPLIT_KV_ATTENTION),
           f"{_M2} (the prefetch's join at the step's end): Qwen3-30B-A3B decode b=1, 433.0 tok/s = 61.9% of the "
           "active roofline (best); the gates pass with it on the MoE shape", WHOLE_ROW),
)
PRESETS: dict[str, Preset] = {p.name: p for p in _PRESETS}


def preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None


def preset_variant(preset_name: str, /, hidden_size: int | None = None, base: VariantSpec | None = None,
                   **knobs) -> VariantSpec:
    """The VariantSpec of preset ``preset_name`` for a model of ``hidden_size`` (needed only by presets with
    whole-row tiles): ``base``'s fields (default: ``VariantSpec()``) with the preset's kernels, kernel parameters
    and name, then ``knobs`` (any VariantSpec field, ``name`` and ``cuda_graph_batch_sizes`` among them) on top;
    ``kernel_params`` among them replaces the preset's whole (its kernels with other parameters)."""
    p = preset(preset_name)
    fields = {"name": p.name, "kernels": dict(p.kernels), **knobs}
    if "kernel_params" not in knobs:
        fields["kernel_params"] = p.params(hidden_size)
    try:
        return dataclasses.replace(base if base is not None else VariantSpec(), **fields)
    except TypeError as e:  # a knob that is no VariantSpec field
        raise ConfigError(f"preset {preset_name}: {e}") from None


# The projections' GEMV tiles of a quantized variant on a GPU, pinned: autotuning them for every captured batch size
# costs more per swap than a slow-tier measurement; these tiles measured best on the 8B shape (bench/RESULTS.md,
# "H200: weight precision").
QUANTIZED_TILES = {"block_n": 8, "block_k": 1024, "num_warps": 8}
# From 1 to 64 rows the projections run on the tensor-core kernel for one-byte weights (kernels/linear/qmma_triton.py,
# its tiles autotuned per shape), except at one row on weights under ``mma_min_numel`` elements, where the GEMV's one
# launch beats the kernel's two in the step. FP8: 64 Mi (8B: QKV, o_proj and down on the GEMV, gate_up and lm_head
# on the kernel); int8: 32 Mi (down on the kernel too: the int8 GEMV converts at a quarter rate). The split and its
# figures against the alternatives: bench/RESULTS.md, "H200: weight precision".
QUANTIZED_MMA = {"fp8": {"mma": 1, "mma_min_numel": 64 << 20}, "int8": {"mma": 1, "mma_min_numel": 32 << 20}}
# The W8A8 GEMM's sums (from 65 rows) kept in the tensor cores' accumulator: on an H100 the 8B's prefill of 8 x 2,048
# tokens 1.62x bf16 against 1.47x with the sums promoted to float32, its last logits as far from bf16's (3.82 against
# 3.84); each GEMM's error 0.005-0.012 of its output's scale against 0.002-0.003 (bench/results/2026-12-07d-h100-
# fp8-accumulation.md). The quality gate judges the form as a whole.
FP8_ACCUMULATION = "fast"
# The one-byte forms' Triton kernels on a GPU with dependent launch, each next kernel scheduled before the wait
# (kernels/pdl.py): on an H100 the 8B's FP8 decode step with every row decoding 4.23 ms at 32 sequences and 4.34 at
# 64 against 4.51 / 4.58 without (static-best bf16 6.70 / 6.78 ms; with pdl 1, 6.59 / 6.67), at one row 3.42
# against 3.59 (bench/results/2026-12-07f-h100-decode-pdl.md).
QUANTIZED_PDL = 2


def quantized_variant(base: VariantSpec, kind: str, device: str, name: str | None = None) -> VariantSpec:
    """``base`` with ``kind`` ("int8" or "fp8") weights. On a GPU its projections are the Triton ones (torch has
    no matrix-vector product for one-byte weights; its FP8 GEMM quantizes the activations first, a pass of seven
    kernels through the library path): the GEMV with pinned tiles for one row of a small weight, the tensor-core
    kernel for one-byte weights otherwise, to 64 rows (``QUANTIZED_MMA[kind]``); every Triton kernel that takes it
    with dependent launch at ``QUANTIZED_PDL``; the other operations and parameters stay ``base``'s."""
    if kind not in QUANTIZED_MMA:
        raise ConfigError(f"quantized weights are int8 or fp8, not {kind!r}")
    kernels, params = dict(base.kernels), {op: dict(p) for op, p in base.kernel_params}
    accumulation = FP8_ACCUMULATION if kind == "fp8" and device.startswith("cuda") else "float32"
    if device.startswith("cuda"):
        for op in TRITON_GEMV:
            if kernels.get(op, "reference") == "reference":
                kernels[op] = "triton"
                params[op] = {**params.get(op, {}), **QUANTIZED_TILES}
            if kernels.get(op) == "triton":
                params[op] = {**params.get(op, {}), **QUANTIZED_MMA[kind]}
        params = with_pdl(params, QUANTIZED_PDL)
    return dataclasses.replace(base, name=name or f"{base.name} + {kind} weights", weight_dtype=kind,
                               kernels=kernels, kernel_params=params, fp8_accumulation=accumulation)


def prefill_graphed(spec: VariantSpec) -> VariantSpec:
    """``spec`` with prefill chunks as long as a step's token budget and its steps with prefill tokens replayed as
    CUDA graphs (``prefill_graph_tokens``: powers of two from 128 up to that budget, and the budget): where FP8's
    projections are shorter than the host's launches, the form that keeps its prefill from running at the host's
    pace (on an H100, one 1,024-token prompt 34.4 ms eager, 18.1 ms so: bf16 28.5 ms;
    bench/results/2026-12-07-h100-prefill-graphs.md). ``spec`` itself when the budget is under 16 tokens."""
    top = spec.max_num_batched_tokens
    if top < 16:
        return spec
    sizes = tuple(x for x in (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768) if x < top) + (top,)
    return dataclasses.replace(spec, prefill_chunk_size=top, prefill_graph_tokens=sizes)


def graphs_alone(base: VariantSpec, other: VariantSpec) -> VariantSpec | None:
    """``base`` with ``other``'s prefill graphs and chunks where ``base`` has none and ``other`` has some, else None:
    the arm that tells a precision candidate's own gain from its graphs' (on Mooncake, H100, 2026-12-07, the graphs
    alone were worth 1.32x to static-best, and FP8 judged against static-best without them claimed 1.74x where its
    own share was 1.34x: bench/results/2026-12-07d-h100-fp8-accumulation.md). Where ``other`` launches with
    dependent launch and ``base`` does not, the arm takes it too, at level 1 (on an H100 the bf16 decode step's
    1.02x; level 2 was not measured for bf16: bench/results/2026-12-07f-h100-decode-pdl.md)."""
    if not other.prefill_graph_tokens or base.prefill_graph_tokens:
        return None
    arm = dataclasses.replace(base, name=f"{base.name}, prefill graphs", prefill_graph_tokens=other.prefill_graph_tokens,
                              prefill_chunk_size=other.prefill_chunk_size)
    theirs, mine = dict(other.kernel_params), dict(base.kernel_params)
    pdl = any(dict(theirs.get(op, {})).get("pdl") for op in PDL_OPS) and not any(
        dict(mine.get(op, {})).get("pdl") for op in PDL_OPS)
    return launched(arm, 1) if pdl else arm
