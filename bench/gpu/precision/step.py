"""9. Where a quantized 8B decode step's time goes, and what shortens it: each projection alone at batch 1 by
precision (the engine's path, the fused kernel, the norm prologue's statistics in one load or in the weights'
chunks, and cuBLAS on a bf16 matrix of the same bytes: what a plain matrix-vector product of that size costs),
then whole steps of each precision in several decode forms (dependent launch levels, the L2 prefetch) and with
each projection's tiles chosen by timing the whole step rather than the kernel alone. The baseline of every
ratio is bf16's best form of the same run."""
from __future__ import annotations

import dataclasses
import time
import traceback

import torch
import torch.nn.functional as F

from bench.gpu.harness import Llama8B, decode_tps, row, section
from engine.config.presets import preset_variant

# (name, N, K, prologue) of the 8B's projections as a decode step calls them
SHAPES = (("qkv", 6144, 4096, "norm"), ("o_proj", 4096, 4096, "plain"), ("gate_up", 28672, 4096, "norm"),
          ("down", 4096, 14336, "act"), ("lm_head", 128256, 4096, "norm"))
# per-op tiles (BLOCK_N, BLOCK_K, warps) tried in the whole step; K is 4,096 for linear / norm_linear, 14,336 for
# act_linear
STEP_TILES = {
    "norm_linear": ((4, 4096, 8), (8, 2048, 8), (4, 2048, 4), (16, 1024, 8), (8, 512, 4)),
    "linear": ((4, 4096, 8), (2, 4096, 4), (8, 2048, 8), (4, 2048, 4), (8, 512, 4)),
    "act_linear": ((4, 2048, 4), (8, 2048, 8), (8, 1024, 8), (16, 512, 8), (4, 4096, 8)),
}


@section
def projections_alone(kinds=("auto", "fp8")) -> None:
    import kernels.linear.linear_triton as lt
    from kernels.linear.linear_triton import graph_time
    from kernels.pointwise.activation import silu_and_mul_ref
    from kernels.pointwise.norm import fused_add_rms_norm_ref
    from kernels.pointwise.norm_triton import fused_add_rms_norm_triton
    from kernels.linear.quant import qlinear_exact, quantize

    torch.manual_seed(2)
    dev = "cuda"
    for name, n, k, prologue in SHAPES:
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        x, r = torch.randn(1, k, device=dev, dtype=torch.bfloat16), torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        nw = torch.randn(k, device=dev, dtype=torch.bfloat16)
        gu = torch.randn(1, 2 * k, device=dev, dtype=torch.bfloat16)
        for kind in kinds:
            wt = w if kind == "auto" else quantize(w, kind)
            nbytes = n * k * (2 if kind == "auto" else 1)
            same = w[: nbytes // (2 * k)]  # bf16 rows of the same bytes
            if prologue == "norm":
                path = lambda: lt.norm_linear_triton(x, r, nw, 1e-5, wt)  # noqa: E731
                fused = lambda: lt._gemv(x, wt, None, lt.ADD_RMS_NORM, {}, r=r, norm_weight=nw, eps=1e-5)  # noqa: E731
                unfused = lambda: lt._after_prologue(fused_add_rms_norm_triton(x, r, nw, 1e-5)[0], wt, None, {}, 4)  # noqa: E731
            elif prologue == "act":
                path = lambda: lt.act_linear_triton(gu, wt)  # noqa: E731
                fused = lambda: lt._gemv(gu, wt, None, lt.SILU_MUL, {}, k=k)  # noqa: E731
                from kernels.pointwise.activation_triton import silu_and_mul_triton

                unfused = lambda: lt._after_prologue(silu_and_mul_triton(gu), wt, None, {}, 4)  # noqa: E731
            else:
                path = lambda: lt.linear_triton(x, wt)  # noqa: E731
                fused = lambda: lt._gemv(x, wt, None, lt.NONE, {})  # noqa: E731
                unfused = lambda: lt._matmul(x, wt)  # noqa: E731
            h = {"norm": lambda: fused_add_rms_norm_ref(x, r, nw, 1e-5)[0], "act": lambda: silu_and_mul_ref(gu),
                 "plain": lambda: x}[prologue]()
            exact = h.double() @ w.double().T if kind == "auto" else qlinear_exact(h, wt)
            try:
                out = path()
                out = out[0] if isinstance(out, tuple) else out
                err = ((out.double() - exact).abs().max() / exact.abs().max()).item()
                t = {label: 1e3 * graph_time(fn) for label, fn in
                     (("path", path), ("kernel", fused), ("unfused", unfused), ("cublas", lambda: F.linear(x, same)))}
                extra = ""
                if prologue == "norm":
                    saved = lt.RSTD_ELEMENTS
                    try:
                        lt.RSTD_ELEMENTS = 0
                        extra = f"; kernel with the statistics in the weights' chunks {1e3 * graph_time(fused):.1f} us"
                    finally:
                        lt.RSTD_ELEMENTS = saved

            except Exception as e:
                traceback.print_exc()
                row(f"{name} {n}x{k} b=1, {kind}", f"FAILED {type(e).__name__}: {str(e)[:160]}")
                continue
            label = "bf16" if kind == "auto" else kind
            limit = 0.05 if kind == "fp8" else 0.01
            row(f"{name} {n}x{k} b=1, {label} ({nbytes / 1e6:.1f} MB)",
                f"{'ERROR ' if err > limit else ''}error {err:.2g} of the output's scale; engine's path {t['path']:.1f} us = {nbytes / t['path'] / 1e3:,.0f} GB/s; kernel {t['kernel']:.1f}, "
                f"unfused {t['unfused']:.1f}; cuBLAS bf16 of the same bytes {t['cublas']:.1f} us{extra}")
        del w


def _forms(m: Llama8B) -> dict:
    """The decode forms tried at each precision (batch 1, one graph)."""
    base = preset_variant("dense-decode", m.mcfg.hidden_size, base=m.engine.variant, cuda_graph_batch_sizes=(1,))
    params = {op: dict(p) for op, p in base.kernel_params}

    def at_level(level: int) -> dict:
        return {op: {**p, "pdl": level} if "pdl" in p else p for op, p in params.items()}

    kernels = {**dict(base.kernels), "prefetch": "triton"}
    return {
        "dense-decode (pdl 1)": base,
        "pdl 2": dataclasses.replace(base, kernel_params=at_level(2)),
        "pdl 2 + next QKV into L2": dataclasses.replace(
            base, kernels=kernels, kernel_params={**at_level(2), "prefetch": {"o_proj": 0, "next_qkv": 2,
                                                                                 "defer_join": 1}}),
        "pdl 1 + o_proj into L2, weights evict-first": dataclasses.replace(
            base, kernels=kernels, kernel_params={**{op: {**p, "evict": 1} if op in STEP_TILES else p
                                                     for op, p in params.items()}, "prefetch": {"defer_join": 1}}),
    }


def _measure(eng, spec, prompt, new) -> float:
    from engine import SamplingParams

    t = time.perf_counter()
    eng.apply_variant(spec)
    eng.block_manager.reset_prefix_cache()
    eng.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))
    prepared = time.perf_counter() - t
    tps = max(decode_tps(eng, prompt, new) for _ in range(2))
    print(f"[prepared in {prepared:.1f} s, measured in {time.perf_counter() - t - prepared:.1f} s]", flush=True)
    return tps


@section
def decode_forms_by_precision(m: Llama8B, kinds=("auto", "fp8", "int8"), sweep=("auto", "fp8"),
                              budget_s: float = 200.0, forms: int | None = None) -> None:
    """Each precision in each decode form (int8 and any kind not in ``sweep``: the first form only; ``forms``: the
    first that many for all), then the tiles of each kind in ``sweep`` timed in the whole step."""
    eng = m.engine
    eng.config = dataclasses.replace(eng.config, async_decode=True)
    prompt, new = list(range(1, 129)), 96
    best: dict[str, tuple[float, str, object]] = {}
    for kind in kinds:
        for form, spec in list(_forms(m).items())[: 1 if kind not in sweep else forms]:
            spec = dataclasses.replace(spec, weight_dtype=kind)
            try:
                tps = _measure(eng, spec, prompt, new)
            except Exception as e:
                traceback.print_exc()
                row(f"8B decode b=1, {kind}, {form}", f"FAILED {type(e).__name__}: {str(e)[:160]}")
                continue
            row(f"8B decode b=1, {'bf16' if kind == 'auto' else kind} weights, {form}", f"{tps:.1f} tok/s")
            if tps > best.get(kind, (0.0,))[0]:
                best[kind] = (tps, form, spec)
    # each op's tiles by the whole step's time (coordinate descent from the best form's autotuned tiles)
    t0 = time.perf_counter()
    for kind in sweep:
        if kind not in best:
            continue
        tps, form, spec = best[kind]
        chosen = {}
        for op, tiles in STEP_TILES.items():
            for bn, bk, nw in tiles:
                if time.perf_counter() - t0 > budget_s:
                    break
                params = {o: dict(p) for o, p in spec.kernel_params}
                params[op] = {**params.get(op, {}), "block_n": bn, "block_k": bk, "num_warps": nw}
                trial = dataclasses.replace(spec, kernel_params=params)
                try:
                    t = _measure(eng, trial, prompt, new)
                except Exception as e:
                    row(f"  tiles {op} {bn}/{bk}/{nw}, {kind}", f"FAILED {type(e).__name__}: {str(e)[:120]}")
                    continue
                if t > tps:
                    tps, spec, chosen[op] = t, trial, (bn, bk, nw)
        best[kind] = (tps, f"{form} + step-timed tiles {chosen or '(none better)'}", spec)
        row(f"8B decode b=1, {'bf16' if kind == 'auto' else kind} weights, best with step-timed tiles",
            f"{tps:.1f} tok/s: {best[kind][1]}")
    if "auto" in best:
        for kind, (tps, form, _) in best.items():
            row(f"8B decode b=1, best {'bf16' if kind == 'auto' else kind}",
                f"{tps:.1f} tok/s = {tps / best['auto'][0]:.2f}x bf16's best ({form})")
    eng.apply_variant(dataclasses.replace(best.get("auto", (0, 0, eng.variant))[2], weight_dtype="auto",
                                          cuda_graph_batch_sizes=()))
