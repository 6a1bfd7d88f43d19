"""12. Quantized weights on the tensor cores for 1-64 rows (kernels/linear/qmma_triton.py): the kernel against its float64
reference and the float64 product first, then each 8B projection alone (the GEMV the engine runs today, this
kernel with its autotuned tiles, and cuBLAS on bf16 matrices of the same bytes and of the layer's own bytes),
then batch-1 decode of each precision with and without it, then decode steps at the batch sizes a loaded server
runs (1-32 sequences) against static-best in bf16. The baseline of every ratio is bf16's form of the same run."""
from __future__ import annotations

import dataclasses
import json
import time
import traceback

import torch
import torch.nn.functional as F
import triton

from bench.gpu.harness import Llama8B, row, section, with_mma
from engine.config.presets import QUANTIZED_MMA
from kernels.linear.tile_table import TileKey


def _chosen(key: TileKey) -> dict:
    """The tiles this process chose for ``key`` on the current GPU (autotuned or from its table), or {}."""
    import kernels.linear.qmma_triton as qm

    entry = next((e for e in qm._TUNED.entries(qm._current_device_name()) if e.key == key), None)
    return {} if entry is None else dict(entry.tiles)


def _chosen_row(keep) -> str:
    """The tiles this process chose on the current GPU for the keys ``keep`` takes, as JSON for a row."""
    import kernels.linear.qmma_triton as qm

    return json.dumps({f"{e.key.block_m}x{e.key.n}x{e.key.k} {e.key.kind} p{e.key.prologue}": e.tiles
                       for e in qm._TUNED.entries(qm._current_device_name()) if keep(e.key)})

SHAPES = (("qkv", 6144, 4096, "norm"), ("o_proj", 4096, 4096, "plain"), ("gate_up", 28672, 4096, "norm"),
          ("down", 4096, 14336, "act"), ("lm_head", 128256, 4096, "norm"))


@section
def qmma_checks() -> bool:
    """The kernel against its float64 reference (the same block-quantized activations: bf16 output rounding
    only) and against the float64 product of the unquantized activations (the activations' quantization)."""
    from kernels.pointwise.activation import silu_and_mul_ref
    from kernels.pointwise.norm import fused_add_rms_norm_ref
    from kernels.linear.qmma_triton import ADD_RMS_NORM, NONE, SILU_MUL, fused_norm_ref, qmma, qmma_ref
    from kernels.linear.quant import qlinear_exact, quantize

    torch.manual_seed(12)
    ok = True
    for kind, fused in (("fp8", 0), ("fp8", 1), ("int8", 0), ("int8", 1)):
        for m, n, k, prologue, split in ((1, 6144, 4096, NONE, 1), (1, 4096, 4096, NONE, 4), (7, 4096, 14336, SILU_MUL, 0),
                                         (16, 28672, 4096, ADD_RMS_NORM, 0), (33, 4096, 4096, NONE, 8),
                                         (64, 1000, 576, ADD_RMS_NORM, 2), (1, 28672, 4096, ADD_RMS_NORM, 4)):
            if (m, prologue) == (1, ADD_RMS_NORM) and not fused:
                continue  # the fused norm's split sums of squares
            qw = quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, kind)
            bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if prologue == NONE else None
            x = torch.randn(m, 2 * k if prologue == SILU_MUL else k, device="cuda", dtype=torch.bfloat16)
            r, nw = torch.randn(m, k, device="cuda", dtype=torch.bfloat16), torch.rand(k, device="cuda") + 0.5
            nw = nw.to(torch.bfloat16)
            tiles = {"block_n": 64, "block_k": 256, "split_k": split, "num_warps": 4, "num_stages": 4, "fused": fused}
            label = f"qmma {kind}{' fused' if fused else ''} {m}x{k} -> {n}, prologue {prologue}, split {split or 'auto'}"
            try:
                rows = None
                if prologue == SILU_MUL:
                    h, summed_ref = silu_and_mul_ref(x), None
                    out, _ = qmma(x, qw, None, SILU_MUL, tiles, k=k)
                elif prologue == ADD_RMS_NORM:
                    h, summed_ref = fused_add_rms_norm_ref(x, r, nw, 1e-5)
                    out, summed = qmma(x, qw, None, ADD_RMS_NORM, tiles, r=r, norm_weight=nw, eps=1e-5)
                    assert torch.equal(summed, summed_ref), "the residual sum differs"
                else:
                    h = x
                    out, _ = qmma(x, qw, bias, NONE, tiles)
                torch.cuda.synchronize()
                again = qmma(x, qw, bias, prologue, tiles, r=r, norm_weight=nw, eps=1e-5,
                             k=k if prologue == SILU_MUL else None, pdl=1)[0]  # with dependent launch: the same
                codes_of = h
                if fused and prologue == ADD_RMS_NORM:  # quantized before the norm's 1 / rms, applied at the end
                    codes_of, rows, _ = fused_norm_ref(x, r, nw, 1e-5)
                ref = qmma_ref(codes_of, qw, 256, bias, rows)
                exact = qlinear_exact(h, qw, bias)
                scale = exact.abs().max().item()
                e_ref = (out.double() - ref).abs().max().item() / scale
                e_exact = (out.double() - exact).abs().max().item() / scale
                same = torch.equal(out, again)  # the split's counts were reset: a second call is the same
            except Exception as e:
                traceback.print_exc()
                row(label, f"FAILED {type(e).__name__}: {str(e)[:160]}")
                ok = False
                continue
            # the activations quantized per 256-column chunk: e4m3 keeps 3 mantissa bits, int8 7 (SiLU-and-multiply's
            # heavy tails measured 0.017 with int8)
            good = e_ref <= 0.006 and e_exact <= (0.05 if kind == "fp8" else 0.02) and same
            ok &= good
            row(label, f"{'OK' if good else 'ERROR'}: {e_ref:.2g} of the output's scale from its float64 reference, "
                       f"{e_exact:.2g} from the unquantized activations' product; repeat (pdl 1) identical: {same}")
    return ok


@section
def qmma_projections(kinds=("fp8", "int8"), rows=(1, 16)) -> None:
    """Each projection alone: the engine's GEMV path, this kernel (autotuned tiles), cuBLAS bf16."""
    import kernels.linear.linear_triton as lt
    import kernels.linear.qmma_triton as qm
    from kernels.linear.linear_triton import graph_time
    from kernels.linear.quant import quantize

    torch.manual_seed(2)
    dev = "cuda"
    for name, n, k, prologue in SHAPES:
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        nw = torch.randn(k, device=dev, dtype=torch.bfloat16)
        for m in rows:
            x, r = torch.randn(m, k, device=dev, dtype=torch.bfloat16), torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            gu = torch.randn(m, 2 * k, device=dev, dtype=torch.bfloat16)
            t_bf16 = 1e3 * graph_time(lambda: F.linear(x, w))
            for kind in kinds:
                qw = quantize(w, kind)
                same = w[: n // 2]  # bf16 rows of the same bytes
                if prologue == "norm":
                    path = lambda: lt.norm_linear_triton(x, r, nw, 1e-5, qw)  # noqa: E731
                    mma = lambda: qm.qmma(x, qw, None, qm.ADD_RMS_NORM, r=r, norm_weight=nw, eps=1e-5)  # noqa: E731
                elif prologue == "act":
                    path = lambda: lt.act_linear_triton(gu, qw)  # noqa: E731
                    mma = lambda: qm.qmma(gu, qw, None, qm.SILU_MUL, k=k)  # noqa: E731
                else:
                    path = lambda: lt.linear_triton(x, qw)  # noqa: E731
                    mma = lambda: qm.qmma(x, qw, None, qm.NONE)  # noqa: E731
                try:
                    t = {label: 1e3 * graph_time(fn) for label, fn in
                         (("path", path), ("mma", mma), ("cublas", lambda: F.linear(x, same)))}
                except Exception as e:
                    traceback.print_exc()
                    row(f"{name} {n}x{k} rows {m}, {kind}", f"FAILED {type(e).__name__}: {str(e)[:160]}")
                    continue
                tiles = _chosen(TileKey(max(16, triton.next_power_of_2(m)), n, k, kind, {
                    "norm": qm.ADD_RMS_NORM, "act": qm.SILU_MUL, "plain": qm.NONE}[prologue]))
                split = qm.split_for(n, k, tiles.get("block_n", 64), tiles.get("block_k", 256))
                nbytes = n * k
                row(f"{name} {n}x{k} rows {m}, {kind} ({nbytes / 1e6:.1f} MB)",
                    f"tensor cores {t['mma']:.1f} us = {nbytes / t['mma'] / 1e3:,.0f} GB/s (tiles {tiles}, split {split}); "
                    f"engine's GEMV path {t['path']:.1f} us; cuBLAS bf16 of the same bytes {t['cublas']:.1f}, of the "
                    f"layer {t_bf16:.1f} us: {t_bf16 / t['mma']:.2f}x")


SWEEP_TILES = ((64, 128, 4, 6), (64, 256, 4, 4), (64, 512, 4, 3), (128, 128, 4, 5), (128, 256, 4, 3),
               (128, 256, 8, 4), (256, 128, 8, 4))


@section
def qmma_sweep(budget_s: float = 200.0) -> None:
    """Batch 1, FP8: each projection through the kernel (its quantization launch included) with every tile of
    SWEEP_TILES and every split of K from 1 to 16 (programs of at least two chunks), the prologue in a launch of its
    own and fused into the multiply, L2 flushed; the five fastest
    per projection and the autotuned choice (kernels/qmma_triton.candidates). gate_up and down first: the two
    furthest from the copy bandwidth; stops after ``budget_s``."""

    import kernels.linear.qmma_triton as qm
    from kernels.linear.linear_triton import graph_time
    from kernels.linear.quant import quantize

    torch.manual_seed(3)
    t0, dev = time.perf_counter(), "cuda"
    order = {"gate_up": 0, "down": 1, "qkv": 2, "o_proj": 3}
    for name, n, k, prologue in sorted((s for s in SHAPES if s[0] in order), key=lambda s: order[s[0]]):
        qw = quantize(torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02, "fp8")
        nw = torch.randn(k, device=dev, dtype=torch.bfloat16)
        x, r = torch.randn(1, k, device=dev, dtype=torch.bfloat16), torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        gu = torch.randn(1, 2 * k, device=dev, dtype=torch.bfloat16)

        def call(tiles):
            if prologue == "norm":
                return qm.qmma(x, qw, None, qm.ADD_RMS_NORM, tiles, r=r, norm_weight=nw, eps=1e-5)
            if prologue == "act":
                return qm.qmma(gu, qw, None, qm.SILU_MUL, tiles, k=k)
            return qm.qmma(x, qw, None, qm.NONE, tiles)

        got = []
        for bn, bk, w, st in SWEEP_TILES:
            for split, fused in ((s, f) for s in (1, 2, 4, 8, 16) for f in (0, 1)):
                if triton.cdiv(k, bk) < 2 * split or time.perf_counter() - t0 > budget_s:
                    continue
                tiles = {"block_n": bn, "block_k": bk, "split_k": split, "num_warps": w, "num_stages": st,
                         "fused": fused}
                try:
                    got.append((1e3 * graph_time(lambda: call(tiles)), tiles))
                except Exception as e:  # a tile the device cannot hold
                    print(f"[{name} {tiles}: {type(e).__name__}: {str(e)[:120]}]", flush=True)
        if not got:
            row(f"qmma sweep {name}", "skipped: the sweep's time was spent")
            continue
        got.sort(key=lambda g: g[0])
        call(None)  # the autotuned choice
        tuned = _chosen(TileKey(16, n, k, "fp8", {"norm": qm.ADD_RMS_NORM, "act": qm.SILU_MUL,
                                                 "plain": qm.NONE}[prologue]))
        t_tuned = 1e3 * graph_time(lambda: call(tuned))
        fmt = lambda t, c: (f"{t:.1f} us = {n * k / t / 1e3:,.0f} GB/s (bn {c['block_n']} bk {c['block_k']} "  # noqa: E731
                            f"w {c['num_warps']} s {c['num_stages']} split {c['split_k']}"
                            f"{' fused' if c.get('fused') else ''})")
        unfused = [g for g in got if not g[1]["fused"]]
        row(f"qmma sweep {name} {n}x{k} fp8 b=1 ({len(got)} tiles, {time.perf_counter() - t0:.0f} s)",
            "; ".join(fmt(t, c) for t, c in got[:5]) + f"; slowest {got[-1][0]:.1f}; the best in two launches "
            + (fmt(*unfused[0]) if unfused else "none") + "; autotuned "
            + fmt(t_tuned, {**tuned, "split_k": tuned.get("split_k", 0)}))


# batch 1: the tuner's own split (engine.config.presets.QUANTIZED_MMA: FP8 on the tensor cores for gate_up and lm_head, the
# GEMV for QKV, o_proj and down; int8 down on the tensor cores too); the other split (down on the kernel: 32 Mi)
MIXED = QUANTIZED_MMA["fp8"]["mma_min_numel"]
MIXED_INT8 = QUANTIZED_MMA["int8"]["mma_min_numel"]
DOWN_ON_MMA = 32 << 20


# gate_up's tiles at one row (block_n, block_k, split, warps, stages) that autotuning chose in runs of 1.57-1.59x
# (64, 256 in one; 128, 256 in two) where a run choosing (128, 128, 1, 4, 5) read 1.55x: each pinned, in one run
GATE_UP_TILES = ((128, 256, 1, 4, 3), (64, 256, 1, 4, 4))


def _pin_norm_linear(spec, tile):
    """``spec`` with the tensor-core kernel's tiles fixed for norm_linear (at one row: gate_up; QKV is the GEMV's)."""
    params = {op: dict(p) for op, p in spec.kernel_params}
    bn, bk, split, warps, stages = tile
    params["norm_linear"] = {**params.get("norm_linear", {}), "mma_block_n": bn, "mma_block_k": bk,
                             "mma_split": split, "mma_warps": warps, "mma_stages": stages}
    return dataclasses.replace(spec, kernel_params=params)


@section
def qmma_decode(m: Llama8B, quick: bool = False, pin: bool = False) -> None:
    """Batch-1 decode: bf16 in the dense-decode form; each precision through the GEMV and through this kernel
    (``quick``: the greedy-token kernel checked and timed; three rounds of bf16, FP8 and int8 split between the GEMV
    and the kernel as the tuner proposes, int8 with down on the GEMV, and (``pin``) FP8 with gate_up's tiles
    pinned (GATE_UP_TILES), each ratio against its round's bf16; then the kernels of one step of bf16 and of the
    tuner's FP8, and the step's greedy token against torch's). The tiles chosen are a row of their own."""
    from bench.gpu.precision.step import _forms, _measure

    eng = m.engine
    eng.config = dataclasses.replace(eng.config, async_decode=True)
    prompt, new = list(range(1, 129)), 96
    base = _forms(m)["dense-decode (pdl 1)"]
    fp8_mixed = with_mma(dataclasses.replace(base, weight_dtype="fp8"), min_numel=MIXED)
    forms = (("bf16, dense-decode", base),
             ("fp8, dense-decode (GEMV)", dataclasses.replace(base, weight_dtype="fp8")),
             ("fp8, dense-decode + tensor cores", with_mma(dataclasses.replace(base, weight_dtype="fp8"))),
             ("fp8, dense-decode + tensor cores for gate_up and lm_head", fp8_mixed),
             ("int8, dense-decode (GEMV)", dataclasses.replace(base, weight_dtype="int8")),
             ("int8, dense-decode + tensor cores for gate_up, down, lm_head",
              with_mma(dataclasses.replace(base, weight_dtype="int8"), min_numel=MIXED_INT8)))
    if quick:
        try:
            greedy_token_kernel()
        except Exception as e:
            traceback.print_exc()
            row("greedy-token kernel", f"FAILED {type(e).__name__}: {str(e)[:160]}")
        rounds = (("bf16, dense-decode", base), ("fp8, the tuner's split", fp8_mixed),
                  *((f"fp8, the tuner's split, gate_up's tile {tile}", _pin_norm_linear(fp8_mixed, tile))
                    for tile in (GATE_UP_TILES if pin else ())),
                  ("int8, the tuner's split", with_mma(dataclasses.replace(base, weight_dtype="int8"),
                                                        min_numel=MIXED_INT8)),
                  ("int8, down on the GEMV (64 Mi)",
                   with_mma(dataclasses.replace(base, weight_dtype="int8"), min_numel=64 << 20)))
        forms = tuple((f"{label} (round {i + 1})", spec) for i in range(3) for label, spec in rounds)
    got = {}
    for label, spec in forms:
        try:
            got[label] = _measure(eng, spec, prompt, new)
        except Exception as e:
            traceback.print_exc()
            row(f"8B decode b=1, {label}", f"FAILED {type(e).__name__}: {str(e)[:160]}")
            continue
        ref = got.get(f"bf16, dense-decode ({label.rsplit('(', 1)[1]}" if quick else "bf16, dense-decode")
        row(f"8B decode b=1, {label}", f"{got[label]:.1f} tok/s" + (f" = {got[label] / ref:.3f}x bf16" if ref else ""))
    if quick:  # where the step's time goes (dependent launch on, as measured), and the graph's greedy token
        from bench.gpu.harness import step_timeline
        from engine import SamplingParams

        for label, spec in (("bf16", base), ("fp8, the tuner's split", fp8_mixed)):
            eng.apply_variant(spec)
            eng.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))
            graph, logits = eng.runner.graphs.graphs[1]
            step_timeline(f"8B decode step b=1, {label}, pdl 1", graph.replay, count=24)
            graph.replay()
            torch.cuda.synchronize()
            token, want = eng.runner.graphs.input_ids[0].item(), logits[0].argmax().item()
            row(f"8B decode step b=1, {label}, pdl 1: the graph's greedy token against torch.argmax",
                "equal" if token == want else f"DIFFERS: {token} against {want}")
    row("qmma tiles chosen (batch 1)", _chosen_row(lambda key: key.block_m == 16))
    eng.apply_variant(dataclasses.replace(base, weight_dtype="auto", cuda_graph_batch_sizes=()))


def greedy_token_kernel() -> None:
    """The decode graph's argmax (kernels/pointwise/argmax_triton.py) against torch.argmax on fresh logits (ties, NaN), and
    both timed on one and on 32 rows of the 8B's vocabulary (``graph_time``: replayed, the L2 flushed)."""
    from kernels.pointwise.argmax_triton import ArgmaxWorkspace, argmax_rows
    from kernels.timing import graph_time

    torch.manual_seed(5)
    vocab = 128256
    work = ArgmaxWorkspace(32, vocab, "cuda")
    bad = 0
    for rows, dtype in ((1, torch.float32), (7, torch.bfloat16), (32, torch.float32)):
        for _ in range(3):
            x = (torch.randn(rows, vocab, device="cuda") * 3).to(dtype)
            x[0, [11, 70000]] = 40.0  # a tie across parts
            if rows > 1:
                x[1, 90000] = float("nan")
            out = torch.empty(rows, dtype=torch.int64, device="cuda")
            bad += int((argmax_rows(x, out, work) != x.argmax(dim=-1)).sum())
    row("greedy-token kernel against torch.argmax (1-32 rows x 128,256, float32 and bf16, ties, NaN)",
        "equal" if bad == 0 else f"FAILED: {bad} rows differ")
    for rows in (1, 32):
        x = torch.randn(rows, vocab, device="cuda")
        out = torch.empty(rows, dtype=torch.int64, device="cuda")
        ours = graph_time(lambda: argmax_rows(x, out, work)) * 1000
        theirs = graph_time(lambda: out.copy_(x.argmax(dim=-1))) * 1000
        row(f"greedy token of {rows} row(s) x 128,256 float32", f"{ours:.1f} us; torch.argmax + copy {theirs:.1f} us")


# the GEMV's tiles (BLOCK_N, BLOCK_K, warps) timed in the whole step for the projections left on it at one row: one
# or two whole rows of one-byte weights per program are requested before the dependent-launch wait
STEP_GEMV_TILES = ((4, 4096, 8), (8, 2048, 8), (8, 4096, 8), (16, 2048, 8), (2, 4096, 4), (8, 1024, 8),
                   (16, 1024, 8), (4, 2048, 4))


@section
def qmma_step_tiles(m: Llama8B, budget_s: float = 240.0, sweep: bool = True) -> None:
    """Batch-1 FP8 decode with the tensor-core kernel for gate_up and lm_head only (``mma_min_numel`` 64 Mi: down,
    QKV and o_proj on the GEMV) against the 32 Mi split and bf16; then (``sweep``) the GEMV's tiles of act_linear
    (down), norm_linear (QKV) and linear (o_proj) timed in the whole step, one operation at a time (coordinate
    descent); then the attention block's KV splits (1, 2, 8 against the automatic 4 at this context) in bf16 and
    FP8; then three rounds of bf16 against the best FP8 and int8 forms (and both with the splits that sped up bf16
    and FP8 alike), and the best form's launches."""
    from bench.gpu.harness import step_timeline
    from bench.gpu.precision.step import _forms, _measure
    from engine import SamplingParams

    eng = m.engine
    eng.config = dataclasses.replace(eng.config, async_decode=True)
    prompt, new = list(range(1, 129)), 96
    base = _forms(m)["dense-decode (pdl 1)"]
    wide = MIXED

    def form(kind, min_numel=wide, tiles=None, splits=0):
        spec = base if kind == "auto" else with_mma(dataclasses.replace(base, weight_dtype=kind), min_numel=min_numel)
        params = {op: dict(p) for op, p in spec.kernel_params}
        for op, (bn, bk, nw) in (tiles or {}).items():
            params[op] = {**params.get(op, {}), "block_n": bn, "block_k": bk, "num_warps": nw}
        if splits:
            params["rotary_attention"] = {**params.get("rotary_attention", {}), "num_splits": splits}
        return dataclasses.replace(spec, kernel_params=params)

    def measure(label, spec, ref=None):
        try:
            tps = _measure(eng, spec, prompt, new)
        except Exception as e:
            traceback.print_exc()
            row(f"8B decode b=1, {label}", f"FAILED {type(e).__name__}: {str(e)[:160]}")
            return 0.0
        row(f"8B decode b=1, {label}", f"{tps:.1f} tok/s" + (f" = {tps / ref:.3f}x bf16" if ref else ""))
        return tps

    bf = measure("bf16, dense-decode", base)
    measure("fp8, tensor cores for gate_up, down, lm_head (32 Mi)", form("fp8", DOWN_ON_MMA), bf)
    best = measure("fp8, tensor cores for gate_up, lm_head (64 Mi)", form("fp8"), bf)
    chosen, t0 = {}, time.perf_counter()
    for op in ("act_linear", "norm_linear", "linear") if sweep else ():
        for tiles in STEP_GEMV_TILES:
            if time.perf_counter() - t0 > budget_s:
                break
            tps = measure(f"  fp8 64 Mi, {op} GEMV tiles {tiles}", form("fp8", tiles={**chosen, op: tiles}), bf)
            if tps > best * 1.002:  # past the spread of repeats in one run
                best, chosen = tps, {**chosen, op: tiles}
    if sweep:
        row("8B decode b=1, fp8 64 Mi: GEMV tiles timed in the step", f"{best:.1f} tok/s with {chosen or 'autotuned'}")
    splits, best_ratio = 0, best / bf
    for s in (1, 2, 8):
        b = measure(f"  bf16, attention in {s} KV splits", form("auto", splits=s))
        f = measure(f"  fp8 64 Mi, attention in {s} KV splits", form("fp8", tiles=chosen, splits=s), b)
        if b > bf * 1.002 and f > best * 1.002 and f / b > best_ratio:
            splits, best_ratio = s, f / b
    row("8B decode b=1: attention KV splits faster for bf16 and FP8 alike", str(splits or "none (automatic: 4)"))
    for i in range(3):
        bf = measure(f"bf16, dense-decode (round {i + 1})", base)
        measure(f"fp8, 64 Mi (round {i + 1})", form("fp8", tiles=chosen), bf)
        measure(f"int8, 64 Mi (round {i + 1})", form("int8", tiles=chosen), bf)
        if splits:
            bfs = measure(f"bf16, attention in {splits} KV splits (round {i + 1})", form("auto", splits=splits))
            measure(f"fp8, 64 Mi, attention in {splits} KV splits (round {i + 1})",
                    form("fp8", tiles=chosen, splits=splits), bfs)
    eng.apply_variant(form("fp8", tiles=chosen, splits=splits))
    eng.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))
    step_timeline("8B decode step b=1, fp8 64 Mi, the best form", eng.runner.graphs.graphs[1][0].replay, count=24)
    eng.apply_variant(dataclasses.replace(base, weight_dtype="auto", cuda_graph_batch_sizes=()))


@section
def qmma_served(m: Llama8B, out=None, batches=(1, 8, 16, 32)) -> None:
    """Decode steps at 1-32 sequences: static-best bf16, its FP8 form on the tensor-core kernel at every row count,
    and its FP8 and int8 forms as the tuner proposes them (engine.config.presets.quantized_variant); the chosen tiles and
    the fastest form's change to ``out``/qmma_change.json (for bench/tuning/capacity_ab.py)."""
    from bench.gpu.precision.serve import served_steps
    from engine.loader.model_source import resolve
    from engine.config.presets import quantized_variant
    from engine.config.static_best import lookup

    eng = m.engine
    base = lookup(resolve("llama-3.1-8b"), "cuda", "bfloat16")
    if base is None:
        row("qmma served", "skipped: no static-best recorded for the 8B on this device")
        return
    fp8 = quantized_variant(base, "fp8", "cuda")
    forms = {"static-best bf16": base,
             "fp8, tensor cores to 64 rows": with_mma(fp8),
             "fp8 as the tuner proposes it (GEMV for QKV, o_proj and down at 1 row, tensor cores otherwise)": fp8,
             "int8 as the tuner proposes it": quantized_variant(base, "int8", "cuda")}
    served_steps(eng, forms, batches, out, "qmma_change.json")
    row("qmma tiles chosen", _chosen_row(lambda key: True))
