"""12. W8A8 FP8 prefill (kernels/linear/w8a8.py): the activations' e4m3 codes made by the norm and activation kernels
checked against the plain-torch references in bf16; each 8B projection at 32-8,192 rows through every form of its
FP8 path (the codes made by the producing kernel, by a one-launch pass after it, by torch's passes, and bare
``torch._scaled_mm`` on codes made beforehand: the ceiling) against cuBLAS bf16 after the same bf16 producer; each
FP8 GEMM with its sums promoted to float32 or kept in the tensor cores' accumulator, row-wise and per tensor
(``w8a8_gemm_accum``); the 8B's prefill of 8 x 2,048 tokens in 8,192-token steps in bf16, FP8 without and with W8A8
(both accumulations), where each step's time goes and the last position's logits against bf16's; decode steps at
1, 32 and 64 sequences, static-best bf16 against its FP8 form as the tuner proposes it; the TTFT of one prompt alone
per length in both forms (``w8a8-ttft``); the host time per call of each W8A8 launch against bf16's
(``w8a8-host``)."""
from __future__ import annotations

import dataclasses
import time
import traceback

import torch
import torch.nn.functional as F

from bench.gpu.harness import Llama8B, graph_timed, kernel_profile, row, section, timed

# (name, N, K, producer) of the 8B's projections
SHAPES = (("qkv", 6144, 4096, "norm"), ("o_proj", 4096, 4096, "plain"), ("gate_up", 28672, 4096, "norm"),
          ("down", 4096, 14336, "act"))


@section
def w8a8_checks() -> bool:
    """The fused producers' codes against the plain-torch references in bf16 (the GPU rounds as torch does: the
    codes should equal but for ties moved by the statistics' summation order), the projections against theirs."""
    from kernels.linear import w8a8
    from kernels.linear import w8a8_triton as wt
    from kernels.linear.quant import quantize, quantize_rows

    torch.manual_seed(11)
    ok = True
    for t, k in ((1, 4096), (300, 4096), (2048, 14336)):
        x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16) * 3
        r = torch.randn_like(x)
        nw = (torch.rand(k, device="cuda") + 0.5).bfloat16()
        gu = torch.randn(t, 2 * k, device="cuda", dtype=torch.bfloat16) * 2
        qw = quantize(torch.randn(4096, k, device="cuda", dtype=torch.bfloat16) * 0.02, "fp8")
        for label, got, want in (
                ("norm", wt.add_rms_norm_fp8(x, r, nw, 1e-5)[:2], w8a8.add_rms_norm_fp8_ref(x, r, nw, 1e-5)[:2]),
                ("silu-mul", wt.silu_and_mul_fp8(gu), w8a8.silu_and_mul_fp8_ref(gu)),
                ("rows", wt.quantize_rows_e4m3(x), quantize_rows(x))):
            (q, s), (q0, s0) = got, want
            same = (q.float() == q0.float()).float().mean().item()
            s_err = ((s - s0).abs() / s0).max().item()
            step = (q0.float().abs() * 2.0 ** -3).clamp(min=2.0 ** -9)
            worst = ((q.float() - q0.float()).abs() / step).max().item()
            good = same > 0.995 and s_err < 1e-5 and worst <= 1.0
            ok &= good
            row(f"W8A8 codes, {label}, {t}x{k} bf16", f"{'OK' if good else 'ERROR'}: {same:.4%} of codes equal to the "
                f"reference's, the rest within {worst:.2f} step; scales within {s_err:.1g}")
        out = wt.norm_linear_w8a8(x, r, nw, 1e-5, qw)[0].float()
        ref = w8a8.norm_linear_w8a8_ref(x, r, nw, 1e-5, qw)[0].float()
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        ok &= err < 0.02
        row(f"W8A8 norm_linear {t}x{k} -> 4096", f"{'OK' if err < 0.02 else 'ERROR'}: {err:.2g} of the output's scale "
            "against the plain-torch W8A8 path")
    return ok


def _forms(name: str, producer: str, m: int, n: int, k: int) -> dict:
    """{label: a call} of one projection at ``m`` rows: bf16 first (the baseline), then the FP8 forms."""
    import kernels.linear.qmma_triton as qm
    from kernels.linear import w8a8_triton as wt
    from kernels.linear.quant import quantize, quantize_rows
    from kernels.linear.quant_triton import quantize_rows_fp8
    from kernels.linear.w8a8 import fp8_rows_mm
    from kernels.pointwise.activation_triton import silu_and_mul_triton
    from kernels.pointwise.norm_triton import fused_add_rms_norm_triton

    dev = "cuda"
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
    qw = quantize(w, "fp8")
    x = torch.randn(m, 2 * k if producer == "act" else k, device=dev, dtype=torch.bfloat16)
    r, nw = torch.randn(m, k, device=dev, dtype=torch.bfloat16), (torch.rand(k, device=dev) + 0.5).bfloat16()
    if producer == "norm":
        bf16_in = lambda: fused_add_rms_norm_triton(x, r, nw, 1e-5)[0]  # noqa: E731
        fused = lambda **kw: wt.norm_linear_w8a8(x, r, nw, 1e-5, qw, **kw)  # noqa: E731
        mma_kw, prologue = dict(r=r, norm_weight=nw, eps=1e-5), qm.ADD_RMS_NORM
    elif producer == "act":
        bf16_in = lambda: silu_and_mul_triton(x)  # noqa: E731
        fused = lambda **kw: wt.act_linear_w8a8(x, qw, **kw)  # noqa: E731
        mma_kw, prologue = dict(k=k), qm.SILU_MUL
    else:
        bf16_in = lambda: x  # noqa: E731
        fused = lambda **kw: wt.linear_w8a8(x, qw, **kw)  # noqa: E731
        mma_kw, prologue = {}, qm.NONE
    codes = quantize_rows(bf16_in())
    forms = {"bf16 cuBLAS": lambda: F.linear(bf16_in(), w),
             "W8A8 (codes from the producer)": fused,
             "the same, fast accumulation (the tuner's form)": lambda: fused(fast_accum=True),
             "bare _scaled_mm (codes made beforehand)": lambda: fp8_rows_mm(*codes, qw),
             "producer, one-launch quantization, _scaled_mm": lambda: fp8_rows_mm(*quantize_rows_fp8(bf16_in()), qw),
             "producer, torch's quantization, _scaled_mm": lambda: fp8_rows_mm(*quantize_rows(bf16_in()), qw)}
    if m <= qm.MAX_M:
        forms["tensor-core kernel (default tiles)"] = lambda: qm.qmma(x, qw, None, prologue, dict(qm.DEFAULT_TILES),
                                                                      **mma_kw)
    return forms


@section
def w8a8_projections(rows=(32, 64, 512, 2048, 8192)) -> None:
    torch.manual_seed(2)
    for name, n, k, producer in SHAPES:
        for m in rows:
            try:
                forms = _forms(name, producer, m, n, k)
                times = {label: graph_timed(fn, calls=10 if m >= 2048 else 20) for label, fn in forms.items()}
            except Exception as e:
                traceback.print_exc()
                row(f"{name} {m}x{n}x{k}", f"FAILED {type(e).__name__}: {str(e)[:160]}")
                continue
            base = times["bf16 cuBLAS"]
            flops = 2 * m * n * k
            row(f"{name} {m}x{n}x{k} ({producer} producer)",
                f"bf16 {1e6 * base:.1f} us ({flops / base / 1e12:.0f} TFLOP/s); " + "; ".join(
                    f"{label} {1e6 * t:.1f} us = {base / t:.2f}x" for label, t in times.items() if label != "bf16 cuBLAS"))
            del forms
            torch.cuda.empty_cache()


@section
def w8a8_gemm_accum(rows=(512, 2048, 8192)) -> None:
    """Each 8B projection's FP8 GEMM alone (codes made beforehand) at prefill rows: row-wise scales (the W8A8 path)
    and one scale per tensor, each with the partial sums promoted to float32 (cuBLAS's default) and kept in the
    tensor cores' accumulator (``use_fast_accum``), against bf16 ``F.linear``; each form's error against the
    float64 product of the same codes and scales, over the output's largest |value|."""
    from kernels.linear.quant import quantize, quantize_rows
    from kernels.linear.w8a8 import fp8_rows_mm

    torch.manual_seed(13)
    one = torch.ones((), device="cuda")
    for name, n, k, _ in SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        qw = quantize(w, "fp8")
        wq64 = qw.q.double()
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            q, s = quantize_rows(x)
            st = (x.float().abs().amax() / 448.0).reshape(())
            qt = (x.float() / st).to(torch.float8_e4m3fn)
            exact_rows = (q.double() @ wq64.t()) * s.double() * qw.scale.double()[None, :]
            exact_tensor = (qt.double() @ wq64.t()) * st.double()
            forms = {"row-wise": (lambda fast: fp8_rows_mm(q, s, qw, fast_accum=fast), exact_rows),
                     "per tensor": (lambda fast: torch._scaled_mm(qt, qw.q.t(), scale_a=st, scale_b=one,
                                                                    out_dtype=torch.bfloat16, use_fast_accum=fast),
                                    exact_tensor)}
            base = graph_timed(lambda: F.linear(x, w), calls=10)
            parts = [f"bf16 {1e6 * base:.1f} us ({2 * m * n * k / base / 1e12:.0f} TFLOP/s)"]
            for label, (fn, exact) in forms.items():
                for fast in (False, True):
                    try:
                        err = ((fn(fast).double() - exact).abs().max() / exact.abs().max()).item()
                        sec = graph_timed(lambda: fn(fast), calls=10)
                        parts.append(f"{label}{', fast' if fast else ''} {1e6 * sec:.1f} us = {base / sec:.2f}x "
                                     f"({2 * m * n * k / sec / 1e12:.0f} TFLOP/s, error {err:.1e})")
                    except Exception as e:  # a form cuBLAS does not take is a row, not a stop
                        parts.append(f"{label}{', fast' if fast else ''} FAILED {type(e).__name__}: {str(e)[:80]}")
            row(f"FP8 GEMM accumulation, {name} {m}x{n}x{k}", "; ".join(parts))
        torch.cuda.empty_cache()


@section
def w8a8_prefill(m: Llama8B, profile: bool = True) -> None:
    """8 x 2,048-token prompts in 8,192-token steps (one output token each), bf16 / FP8 without W8A8 (its GEMM's
    input quantized in a launch of its own after the bf16 norm or activation) / FP8 W8A8, each timed after the
    same batch ran once; the last position's logits of one 2,048-token prompt against bf16's."""
    from bench.gpu.precision.weights import _logits, prefill_seconds
    from engine import SamplingParams
    from engine.config.presets import preset_variant
    from engine.model import precision

    eng = m.engine
    n_p, length = 8, 2048
    gen = torch.Generator().manual_seed(0)
    pp = [torch.randint(0, 128000, (length,), generator=gen).tolist() for _ in range(n_p)]
    form = preset_variant("triton-paged", max_num_seqs=64, max_num_batched_tokens=8192)
    rates, ref_logits, keep = {}, None, precision.W8A8_MIN_ROWS
    arms = (("bf16", "auto", keep, "float32"), ("fp8 without W8A8", "fp8", 1 << 30, "float32"),
            ("fp8 W8A8", "fp8", keep, "float32"), ("fp8 W8A8, fast accumulation", "fp8", keep, "fast"))

    def step():
        eng.block_manager.reset_prefix_cache()
        eng.generate(pp[:4], SamplingParams(max_tokens=1, ignore_eos=True))

    for label, kind, min_rows, accumulation in arms:
        precision.W8A8_MIN_ROWS = min_rows
        try:
            eng.apply_variant(dataclasses.replace(form, weight_dtype=kind, fp8_accumulation=accumulation))
            dt = prefill_seconds(eng, pp)
            logits = _logits(eng, pp[0])
            if profile and label != "fp8 without W8A8":
                kernel_profile(f"8B prefill step of 8192 tokens, {label}", step, steps=3, top=10)
        except Exception as e:
            traceback.print_exc()
            row(f"8B prefill, {label}", f"FAILED {type(e).__name__}: {str(e)[:200]}")
            continue
        finally:
            precision.W8A8_MIN_ROWS = keep
        rates[label] = n_p * length / dt
        ref_logits = logits if ref_logits is None else ref_logits
        err = (logits - ref_logits).abs().max().item()
        row(f"8B prefill {n_p} x {length} tokens, 8192-token steps, {label}",
            f"{rates[label]:,.0f} tok/s" + (f" = {rates[label] / rates['bf16']:.2f}x bf16; last-position logits vs "
                                            f"bf16: max |d| {err:.3g} (max |logit| {ref_logits.abs().max():.2f})"
                                            if "bf16" in rates and label != "bf16" else ""))
    eng.block_manager.reset_prefix_cache()


@section
def w8a8_served(m: Llama8B, out=None, batches=(1, 32, 64)) -> None:
    """Decode steps of static-best bf16 and its FP8 form as the tuner proposes it at 1, 32 and 64 sequences (64 rows
    at once with both widened to 64: ``served_steps``), each also with programmatic dependent launch on its Triton
    kernels (pdl 1 and, for FP8, 2: kernels/pdl.py), and the kernels of each one's step at 32. (The W8A8 GEMM from
    32 rows was slower on an H100, 1.22x / 1.17x against the tensor-core kernel's 1.30x / 1.29x:
    bench/results/2026-12-07e-h100-bursty-fair-decode.md.)"""
    from bench.gpu.precision.serve import served_steps
    from engine.config.presets import launched, quantized_variant
    from engine.config.static_best import lookup
    from engine.loader.model_source import resolve

    base = lookup(resolve("llama-3.1-8b"), "cuda", "bfloat16")
    if base is None:
        row("W8A8 served", "skipped: no static-best recorded for the 8B on this device")
        return
    fp8 = quantized_variant(base, "fp8", "cuda")
    served_steps(m.engine, {"static-best bf16": base, "static-best bf16 + pdl 1": launched(base, 1),
                            "fp8 as the tuner proposes it": fp8, "fp8 + pdl 1": launched(fp8, 1),
                            "fp8 + pdl 2": launched(fp8, 2)}, batches, out, "w8a8_change.json", profile_at=32)


@section
def w8a8_quant_passes(t: int = 8192, width: int = 14336) -> None:
    """The activation's codes before down at a prefill step's rows (silu(gate) * up, ``width`` wide) and o_proj's
    (rows of 4,096): the whole row in one pass from registers against two passes of 2,048 columns; both checked
    equal to each other."""
    from kernels.linear import w8a8_triton as wt

    torch.manual_seed(12)
    for label, x, fn in (("silu-mul", torch.randn(t, 2 * width, device="cuda", dtype=torch.bfloat16) * 2,
                          wt.silu_and_mul_fp8),
                         ("rows", torch.randn(t, 4096, device="cuda", dtype=torch.bfloat16) * 3,
                          wt.quantize_rows_e4m3)):
        (q1, s1), (q2, s2) = fn(x, one_pass=True), fn(x, one_pass=False)
        same = torch.equal(q1.float(), q2.float()) and torch.equal(s1, s2)
        one, two = timed(lambda: fn(x, one_pass=True)), timed(lambda: fn(x, one_pass=False))
        nbytes = x.numel() * 2 + q1.numel()
        row(f"W8A8 codes, {label}, {t} x {x.shape[1]} bf16: one pass / two passes",
            f"{'OK' if same else 'ERROR (codes differ)'}: {one * 1e6:.0f} / {two * 1e6:.0f} us = {two / one:.2f}x; "
            f"one pass {nbytes / one / 1e9:,.0f} GB/s")
        forms = {f"one pass, {w} warps": dict(one_pass=True, warps=w) for w in (4, 8, 16, 32)}
        forms.update({f"two passes of {b}, {w} warps": dict(one_pass=False, block=b, warps=w)
                      for b in (1024, 2048, 4096) for w in (4, 8)})
        for name, kw in forms.items():  # the tile sweep: each form's codes equal the default's
            try:
                q, s = fn(x, **kw)
                ok = torch.equal(q.float(), q1.float()) and torch.equal(s, s1)
                sec = timed(lambda: fn(x, **kw))
                row(f"W8A8 codes, {label}, {t} x {x.shape[1]}, {name}",
                    f"{'OK' if ok else 'ERROR (codes differ)'}: {sec * 1e6:.0f} us, {nbytes / sec / 1e9:,.0f} GB/s")
            except Exception as e:  # a form the compiler cannot fit (registers, shared memory) is a row, not a stop
                row(f"W8A8 codes, {label}, {t} x {x.shape[1]}, {name}", f"FAILED {type(e).__name__}: {str(e)[:120]}")
    from kernels.pointwise.activation_triton import silu_and_mul_triton

    x = torch.randn(t, 2 * width, device="cuda", dtype=torch.bfloat16)
    sec = timed(lambda: silu_and_mul_triton(x))
    row(f"bf16 SiLU-and-multiply (the bf16 step's kernel), {t} x {2 * width}",
        f"{sec * 1e6:.0f} us, {(x.numel() * 3 // 2) * 2 / sec / 1e9:,.0f} GB/s")


@section
def prefill_attention_kernels(n_seq: int = 4, length: int = 2048) -> None:
    """The prefill attention kernel (kernels/attention/prefill_triton.py) on the 8B's heads (32 query, 8 KV, 128
    wide) for ``n_seq`` x ``length``-token prompts in one step, over a paged cache of 16-token blocks in shuffled
    order: its output against float32 SDPA on the same keys, then its time in several tiles (the tiles the
    triton-paged preset gave it before it had its own, and the new defaults) against torch's flash SDPA on
    contiguous heads (the ceiling)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kernels.attention.attention import AttentionMetadata
    from kernels.attention.prefill_triton import PREFILL_TILES, prefill_attention

    h, kvh, d, bs = 32, 8, 128, 16
    gen = torch.Generator(device="cuda").manual_seed(5)
    t = n_seq * length
    q = torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(n_seq, length, kvh, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    per = length // bs
    order = torch.randperm(n_seq * per, device="cuda", generator=gen)
    k_cache = torch.empty(n_seq * per, bs, kvh, d, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.empty_like(k_cache)
    k_cache[order] = k.view(n_seq * per, bs, kvh, d)
    v_cache[order] = v.view(n_seq * per, bs, kvh, d)
    tables = order.view(n_seq, per).to(torch.int32).contiguous()
    meta = AttentionMetadata.build(torch.zeros(t, dtype=torch.int64, device="cuda"), tables, [length] * n_seq,
                                   [i * length for i in range(n_seq + 1)], "cuda")
    scale = d ** -0.5
    qh = q.view(n_seq, length, h, d).transpose(1, 2)  # (B, H, L, D)
    kh = k.transpose(1, 2).repeat_interleave(h // kvh, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(h // kvh, dim=1)
    ref = F.scaled_dot_product_attention(qh.float(), kh.float(), vh.float(), is_causal=True, scale=scale)
    got = prefill_attention(q, k_cache, v_cache, meta, scale).view(n_seq, length, h, d).transpose(1, 2)
    err = (got.float() - ref).abs().max().item()
    row(f"prefill attention {n_seq} x {length}, 32/8 heads x 128, paged", f"{'OK' if err < 0.03 else 'ERROR'}: max "
        f"|d| {err:.3g} against float32 SDPA (bf16 inputs)")
    flops = 2 * h * d * length * length * n_seq  # QK and PV, causal half, 2 flops each

    def rate(seconds: float) -> str:
        return f"{seconds * 1e3:.2f} ms, {flops / seconds / 1e12:.0f} TFLOP/s"

    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            base = timed(lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale))
        row("prefill attention, torch flash SDPA, contiguous heads (ceiling)", rate(base))
    except RuntimeError as e:
        base = None
        row("prefill attention, torch flash SDPA", f"unavailable: {str(e)[:120]}")
    tiles = [("triton-paged preset's before (32 x 128, 8 warps, 2 stages)", 32, 128, 8, 2),
             ("plain default before (32 x 32, 4 warps, 2 stages)", 32, 32, 4, 2),
             ("new default ({block_m} x {block_n}, {num_warps} warps, {num_stages} stages)".format(**PREFILL_TILES),
              *PREFILL_TILES.values())]
    tiles += [(f"{bm} x {bn}, {w} warps, {s} stages", bm, bn, w, s)
              for bm, bn, w, s in ((64, 64, 4, 3), (128, 128, 8, 2), (128, 32, 4, 3), (64, 128, 4, 2), (128, 64, 4, 3))]
    tiles.append(("new default tiles, while loops (not pipelined)", *PREFILL_TILES.values(), False))
    for label, bm, bn, w, s, *counted in tiles:
        try:
            sec = timed(lambda: prefill_attention(q, k_cache, v_cache, meta, scale, bm, bn, w, s, *counted))
        except Exception as e:  # a tile the device cannot hold
            row(f"prefill attention, {label}", f"failed: {type(e).__name__}")
            continue
        row(f"prefill attention, {label}", rate(sec) + (f" = {base / sec:.2f}x flash SDPA" if base else ""))


@section
def decode_attention_kernels(n_seq: int = 64, length: int = 2048) -> None:
    """The decode attention kernel (its counted key loop) on the 8B's heads for ``n_seq`` sequences of ``length``
    tokens of context in a paged cache of 16-token blocks in shuffled order, bf16 and e4m3: against
    ``paged_attention_ref``, then the cache bytes it streams per second, whole and split."""
    from kernels.attention.attention import AttentionMetadata, paged_attention_ref
    from kernels.attention.attention_triton import paged_attention_triton

    h, kvh, d, bs = 32, 8, 128, 16
    gen = torch.Generator(device="cuda").manual_seed(6)
    per = length // bs
    k_cache = torch.randn(n_seq * per, bs, kvh, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(n_seq * per, device="cuda", generator=gen).view(n_seq, per).to(torch.int32).contiguous()
    q = torch.randn(n_seq, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    meta = AttentionMetadata.build(torch.zeros(n_seq, dtype=torch.int64, device="cuda"), tables, [length] * n_seq,
                                   list(range(n_seq + 1)), "cuda")
    scale = d ** -0.5
    for label, kc, vc in (("bf16", k_cache, v_cache),
                          ("e4m3", k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn))):
        ref = paged_attention_ref(q, kc, vc, meta, scale).float()
        nbytes = 2 * kc.numel() * kc.element_size()
        # static-best on the 8B (one split, 128 keys, 8 warps), the split-KV preset, and deeper pipelines
        # and for e4m3, each again with its tiles widened to float16 instead of bfloat16 (``fp8_f16``)
        for f16 in ((0, 1) if label == "e4m3" else (0,)):
            for splits, block_n, warps, stages in ((1, 128, 8, 2), (1, 128, 8, 3), (0, 32, 4, 2), (0, 64, 4, 3),
                                                   (1, 64, 4, 3)):
                fn = lambda: paged_attention_triton(q, kc, vc, meta, scale, num_splits=splits,  # noqa: E731
                                                    block_n=block_n, num_warps=warps, num_stages=stages,
                                                    fp8_f16=f16)
                err = (fn().float() - ref).abs().max().item()
                sec = timed(fn)
                row(f"decode attention {n_seq} x {length} context, {label} cache{' widened to f16' if f16 else ''}, "
                    f"splits {splits or 'auto'}, {block_n} keys, {warps} warps, {stages} stages",
                    f"{'OK' if err < 0.02 else 'ERROR'} (max |d| {err:.2g}); {sec * 1e6:.0f} us, "
                    f"{nbytes / sec / 1e9:,.0f} GB/s of cache")


@section
def w8a8_ttft(m: Llama8B, lengths=(128, 512, 1024, 2048), reps: int = 5, quick: bool = False) -> None:
    """Time to first token of one prompt alone (the served TTFT at a low rate), static-best bf16 against its FP8
    form (``quantized_variant``), that form with prefill chunks two and four times as long (its projections take
    about half the time, and at static-best's chunks the host's launches outlast its kernels), both precisions
    with their steps with prefill tokens replayed as CUDA graphs (``prefill_graph_tokens``), and the form the tuner
    proposes (``prefill_graphed``: graphs and step-long chunks), per prompt length: the median of ``reps`` runs
    after two warm-up runs of each length, the prefix cache emptied before each; where a 1,024-token prefill's time
    goes in each form. A graphed form's first logits are checked against its eager form's first. ``quick``: bf16,
    fp8 and fp8's graphed forms, prompts of 512 tokens or more."""
    from engine import SamplingParams
    from engine.config.presets import prefill_graphed, quantized_variant
    from engine.config.static_best import lookup
    from engine.loader.model_source import resolve

    base = lookup(resolve("llama-3.1-8b"), "cuda", "bfloat16")
    if base is None:
        row("W8A8 TTFT", "skipped: no static-best recorded for the 8B on this device")
        return
    eng = m.engine
    gen = torch.Generator().manual_seed(1)
    prompts = {n: torch.randint(0, 128000, (n,), generator=gen).tolist() for n in lengths}
    ms: dict[str, dict[int, float]] = {}

    def once(p):
        eng.block_manager.reset_prefix_cache()
        torch.cuda.synchronize()
        t = time.perf_counter()
        eng.generate([p], SamplingParams(max_tokens=1, ignore_eos=True))
        torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - t)

    def first_logits(p) -> torch.Tensor:
        got: list[torch.Tensor] = []
        eng.logits_sink = lambda ids, logits: got.append(logits.float().clone())
        try:
            once(p)
        finally:
            eng.logits_sink = None
        return got[0][0]

    fp8 = quantized_variant(base, "fp8", "cuda")
    chunk = fp8.prefill_chunk_size or fp8.max_num_batched_tokens
    top = fp8.max_num_batched_tokens
    graphed = prefill_graphed(fp8).prefill_graph_tokens
    forms = {"static-best bf16": base, "its fp8 form": fp8}
    forms |= {f"fp8, chunks x{k}": dataclasses.replace(fp8, prefill_chunk_size=min(k * chunk, top)) for k in (2, 4)}
    forms |= {"bf16, prefill graphs": dataclasses.replace(base, prefill_graph_tokens=graphed),
              "fp8, prefill graphs": dataclasses.replace(fp8, prefill_graph_tokens=graphed),
              "fp8, prefill graphs, step-long chunks (the tuner's form)": prefill_graphed(fp8)}
    if quick:
        forms = {k: v for k, v in forms.items() if k in ("static-best bf16", "its fp8 form", "fp8, prefill graphs",
                                                         "fp8, prefill graphs, step-long chunks (the tuner's form)")}
        prompts = {n: p for n, p in prompts.items() if n >= 512}
    eager_logits: dict[str, torch.Tensor] = {}
    for label, spec in forms.items():
        try:
            eng.apply_variant(spec)
        except Exception as e:  # a capture that fails is a figure too
            row(f"8B TTFT, {label}", f"ERROR: {type(e).__name__}: {e}")
            continue
        kind = "fp8" if spec.weight_dtype == "fp8" else "bf16"
        probe = first_logits(prompts[1024])
        if not spec.prefill_graph_tokens:
            eager_logits.setdefault(kind, probe)
        elif kind in eager_logits:
            ref = eager_logits[kind]
            err = (probe - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
            row(f"8B {label}: first logits of a 1,024-token prompt against the eager form's",
                f"{'OK' if err < 2e-2 else 'ERROR'} (max |d| / max |logit| {err:.2g}; argmax "
                f"{'equal' if probe.argmax() == ref.argmax() else 'differs'})")
        ms[label] = {}
        for n, p in prompts.items():
            once(p), once(p)
            ms[label][n] = sorted(once(p) for _ in range(reps))[reps // 2]
        kernel_profile(f"8B prefill of one 1,024-token prompt, {label}", lambda: once(prompts[1024]), steps=3, top=8)
    for n in prompts:
        b = ms.get("static-best bf16", {}).get(n)
        if b is None:
            continue
        row(f"8B TTFT of one {n}-token prompt", f"bf16 {b:.2f} ms; " + "; ".join(
            f"{label} {t[n]:.2f} ms: {b / t[n]:.2f}x" for label, t in ms.items() if label != "static-best bf16"))
    eng.apply_variant(base)
    eng.block_manager.reset_prefix_cache()


@section
def w8a8_host_cost(rows=(16, 1024), calls: int = 300) -> None:
    """Host time per call of each launch of a W8A8 projection against bf16's (o_proj's shape, 4,096 x 4,096): the
    seconds ``calls`` back-to-back calls take to enqueue, over ``calls`` (at 16 rows the GPU finishes each call
    before the next is issued, so the host bounds the rate), beside each call's GPU time. A prefill chunk (512 rows
    in static-best) whose host cost per layer exceeds its GPU time runs at the host's pace."""
    from kernels.linear import w8a8_triton as wt
    from kernels.linear.quant import quantize
    from kernels.linear.w8a8 import fp8_rows_mm
    from engine.model.precision import w8a8_device
    from kernels.pointwise.norm_triton import fused_add_rms_norm_triton

    torch.manual_seed(13)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    qw = quantize(w, "fp8")
    nw = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    for t in rows:
        x = torch.randn(t, 4096, device="cuda", dtype=torch.bfloat16)
        r = torch.randn_like(x)
        q, s = wt.quantize_rows_e4m3(x)
        forms = {"bf16 F.linear": lambda: F.linear(x, w), "torch._scaled_mm row-wise": lambda: fp8_rows_mm(q, s, qw),
                 "rows' codes (Triton, one launch)": lambda: wt.quantize_rows_e4m3(x),
                 "add + RMSNorm + codes (Triton)": lambda: wt.add_rms_norm_fp8(x, r, nw, 1e-5),
                 "add + RMSNorm bf16 (Triton)": lambda: fused_add_rms_norm_triton(x, r, nw, 1e-5),
                 "linear_w8a8 (codes + _scaled_mm)": lambda: wt.linear_w8a8(x, qw),
                 "the W8A8 path's device check (per projection)": lambda: w8a8_device(x)}
        for label, fn in forms.items():
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            host = (time.perf_counter() - start) / calls
            torch.cuda.synchronize()
            row(f"host per call, {t} rows, {label}", f"{host * 1e6:.1f} us host; {timed(fn) * 1e6:.1f} us GPU")
