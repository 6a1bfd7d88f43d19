"""11. Quantized weights as the tuner serves them: the activations' one-launch FP8 quantization checked against
the plain-torch path, then decode steps at the batch sizes a loaded server runs (1-32 sequences) for static-best
in bf16, static-best with FP8 weights through the library's GEMM (the tuner's first precision candidate), and
with the Triton projections (its candidate now: ``ops.search.tune.Search.precision_candidate``)."""
from __future__ import annotations

import dataclasses
import time
import traceback
from contextlib import contextmanager

import torch

from bench.gpu.harness import Llama8B, row, section, with_mma


@section
def activation_quant_checks() -> bool:
    """quantize_rows_fp8 against kernels.quant's plain-torch quantize_rows, and the FP8 GEMM it feeds against the
    float64 product."""
    from kernels.linear.quant import _fp8_gemm, qlinear_exact, quantize, quantize_rows
    from kernels.linear.quant_triton import quantize_rows_fp8

    torch.manual_seed(5)
    ok = True
    for t, k, n, mag in ((1, 4096, 6144, 1.0), (7, 14336, 4096, 30.0), (300, 4096, 4096, 0.01), (16, 4096, 128, 1e3)):
        x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16) * mag
        x[0, 3] = 0.0
        q, s = quantize_rows_fp8(x)
        ref_q, ref_s = quantize_rows(x)
        ref_q = ref_q.float()
        s_err = ((s - ref_s).abs() / ref_s).max().item()
        same = (q.float() == ref_q).float().mean().item()
        step = (ref_q.abs() * 2.0 ** -3).clamp(min=2.0 ** -9)  # one e4m3 step at each magnitude
        worst = ((q.float() - ref_q).abs() / step).max().item()
        qw = quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, "fp8")
        exact = qlinear_exact(x, qw)
        scale = exact.abs().max().item()
        e_new = (_fp8_gemm(x, qw, None, quantize_rows_fp8).double() - exact).abs().max().item() / scale
        e_old = (_fp8_gemm(x, qw, None).double() - exact).abs().max().item() / scale
        good = s_err < 1e-6 and same > 0.999 and worst <= 1.0 and e_new <= 0.05
        ok &= good
        row(f"FP8 activation quantization, {t}x{k} (|x| ~ {mag:g})",
            f"{'OK' if good else 'ERROR'}: scales within {s_err:.1g}; {same:.4%} of codes equal to torch's, the rest "
            f"within {worst:.2f} step; GEMM error {e_new:.3g} of the output's scale (torch's path {e_old:.3g})")
    return ok


def _prompts(b: int, ctx: int) -> list[list[int]]:
    """``b`` distinct prompts of ``ctx`` tokens (no shared prefix to cache)."""
    return [[(i * 7919 + j * 31) % 30000 + 10 for j in range(ctx)] for i in range(b)]


@contextmanager
def _decoding(eng, b: int, ctx: int, max_tokens: int):
    """``b`` sequences of ``ctx`` tokens admitted and stepped until each has its first token (the prefills done),
    so that every step inside the block is a decode step of all ``b``; aborted and drained on leaving."""
    from engine import SamplingParams

    eng.block_manager.reset_prefix_cache()
    ids = [eng.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in _prompts(b, ctx)]
    try:
        started: set = set()
        while len(started) < b and eng.has_unfinished():
            started.update(o.request_id for o in eng.step() if o.token_ids)
        yield
    finally:
        for rid in ids:
            eng.abort(rid)
        while eng.has_unfinished():
            eng.step()


def _step_ms(eng, b: int, ctx: int = 192, new: int = 32) -> float:
    """A decode step's time at ``b`` sequences of ``ctx`` tokens: a run of ``new`` steps less the prefill's."""
    from engine import SamplingParams

    prompts = _prompts(b, ctx)

    def run(tokens: int) -> float:
        eng.block_manager.reset_prefix_cache()
        torch.cuda.synchronize()
        t = time.perf_counter()
        eng.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))
        torch.cuda.synchronize()
        return time.perf_counter() - t

    run(2)  # first use of this batch size
    return 1e3 * (min(run(new + 1) for _ in range(2)) - min(run(1) for _ in range(2))) / new


def _decode_only_ms(eng, b: int, ctx: int = 192, steps: int = 16) -> float:
    """A decode step's time at ``b`` sequences of ``ctx`` tokens with every prefill done before the clock starts:
    ``steps`` consecutive engine steps in which every row is a decode row (``_step_ms``'s difference of two runs
    also holds the steps where the first sequences decode beside the last prefill chunks). At most the variant's
    ``max_num_seqs`` (the caller's bound)."""
    with _decoding(eng, b, ctx, max_tokens=3 * steps + 16):
        for _ in range(steps // 2):  # the decode graph's first replays
            eng.step()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - t) / steps


def _widened_ms(eng, spec, b: int) -> float:
    """``_decode_only_ms`` at ``b`` sequences, more than ``spec`` runs at once: ``spec`` with ``max_num_seqs`` and a
    decode graph of ``b`` rows (the step's cost at that many rows, against the same widening of the baseline)."""
    eng.apply_variant(dataclasses.replace(spec, max_num_seqs=b,
                                          cuda_graph_batch_sizes=tuple(spec.cuda_graph_batch_sizes) + (b,)))
    try:
        return _decode_only_ms(eng, b)
    finally:
        eng.apply_variant(spec)


def fp8_forms(base) -> dict:
    """static-best with FP8 weights in the forms compared here: {label: VariantSpec}."""
    from engine.config.presets import TRITON_GEMV, quantized_variant


    pinned = with_mma(quantized_variant(base, "fp8", "cuda"), 0)  # the GEMV form, before the tensor-core kernel
    params = {op: dict(p) for op, p in pinned.kernel_params}
    gemm_only = {**params, **{op: {**params.get(op, {}), "max_m": 0} for op in TRITON_GEMV}}
    return {"fp8, library GEMM (torch's activation quantization)": dataclasses.replace(base, weight_dtype="fp8"),
            "fp8, Triton GEMV to 4 rows (pinned tiles), FP8 GEMM above": pinned,
            "fp8, FP8 GEMM at every batch (one-launch activation quantization)": dataclasses.replace(
                pinned, kernel_params=gemm_only)}


@section
def served_decode_by_precision(m: Llama8B, out=None, batches=(1, 8, 16, 32)) -> None:
    """Decode steps by form; the fastest FP8 form's change to static-best goes to ``out``/fp8_change.json (for
    bench/tuning/capacity_ab.py)."""

    from engine.loader.model_source import resolve
    from engine.config.static_best import lookup

    eng = m.engine
    base = lookup(resolve("llama-3.1-8b"), "cuda", "bfloat16")
    if base is None:
        row("served decode by precision", "skipped: no static-best recorded for the 8B on this device")
        return
    served_steps(eng, {"static-best bf16": base, **fp8_forms(base)}, batches, out, "fp8_change.json")


def decode_profile(eng, label: str, b: int, ctx: int = 192, steps: int = 8) -> None:
    """The kernels of the served decode step at ``b`` sequences of ``ctx`` tokens (``kernel_profile``: GPU time
    per kernel and the step's time no kernel covers), after every sequence's prefill, as the step replays."""
    from bench.gpu.harness import kernel_profile

    with _decoding(eng, b, ctx, max_tokens=4 * steps + 16):
        kernel_profile(f"8B decode step at {b} sequences, {label}", eng.step, steps=steps, top=12)


def served_steps(eng, forms: dict, batches, out, change_file: str, profile_at: int = 0) -> None:
    """Decode steps of each form (the first is the baseline) at each batch size, a row per form, and with
    ``profile_at`` the kernels of each form's step at that many sequences (``decode_profile``); the fastest other
    form's change to the baseline (over the batches) to ``out``/``change_file`` (for bench/tuning/capacity_ab.py)."""
    import json

    base_label = next(iter(forms))
    got: dict[str, dict[int, float]] = {}
    alone: dict[str, dict[int, float]] = {}
    for label, spec in forms.items():
        try:
            t = time.perf_counter()
            eng.apply_variant(spec)
            prepared = time.perf_counter() - t
            got[label] = {b: _step_ms(eng, b) for b in batches}
            alone[label] = {b: _decode_only_ms(eng, b) for b in batches if b <= spec.max_num_seqs}
        except Exception as e:
            traceback.print_exc()
            row(f"8B decode step, {label}", f"FAILED {type(e).__name__}: {str(e)[:160]}")
            continue
        ref = got.get(base_label)
        row(f"8B decode step, {label} (prepared in {prepared:.1f} s)",
            "; ".join(f"b={b} {ms:.2f} ms" + (f" ({ref[b] / ms:.2f}x)" if ref and label != base_label else "")
                      for b, ms in got[label].items()))
        ref_alone = alone.get(base_label)
        row(f"8B decode step, {label}, every row a decode row (16 steps after the prefills)",
            "; ".join(f"b={b} {ms:.2f} ms" + (f" ({ref_alone[b] / ms:.2f}x)" if ref_alone and label != base_label
                                              else "") for b, ms in alone[label].items()))
        if profile_at:
            try:
                decode_profile(eng, label, profile_at)
            except Exception as e:  # the profile is a row of its own: the step's time above stands
                traceback.print_exc()
                row(f"8B decode step at {profile_at} sequences, {label}: profile", f"FAILED {type(e).__name__}: "
                    f"{str(e)[:160]}")
        for b in (b for b in batches if b > spec.max_num_seqs):
            try:
                alone[label][b] = _widened_ms(eng, spec, b)
            except Exception as e:
                traceback.print_exc()
                row(f"8B decode step, {label}, {b} rows at once", f"FAILED {type(e).__name__}: {str(e)[:160]}")
                continue
            ref = alone.get(base_label, {}).get(b)
            row(f"8B decode step, {label}, {b} rows at once (max_num_seqs and a decode graph widened to {b}; "
                f"as served, {spec.max_num_seqs} at a time)",
                f"{alone[label][b]:.2f} ms" + (f" ({ref / alone[label][b]:.2f}x)" if ref and label != base_label
                                               else ""))
    eng.apply_variant(forms[base_label])
    others = {k: sum(v.values()) for k, v in got.items() if k != base_label}
    if others and out is not None:
        best = forms[min(others, key=others.get)]
        change = {"weight_dtype": best.weight_dtype, "kernels": dict(best.kernels),
                  "kernel_params": {op: dict(p) for op, p in best.kernel_params}}
        (out / change_file).write_text(json.dumps(change))
        row("fastest form over the batches", min(others, key=others.get))


@section
def pdl_tokens(m: Llama8B, b: int = 32, ctx: int = 192, new: int = 48) -> bool:
    """Dependent launch changes when kernels start, not what they compute: the greedy tokens of ``b`` sequences of
    ``ctx`` tokens, ``new`` each, under static-best bf16 and its FP8 form (``quantized_variant``, pdl 2), each
    without pdl and at levels 1 and 2, must equal its form's without pdl token for token (a kernel that touched an
    earlier kernel's output before its wait would show here as a difference)."""
    from engine import SamplingParams
    from engine.config.presets import launched, quantized_variant
    from engine.config.static_best import lookup
    from engine.loader.model_source import resolve

    eng = m.engine
    base = lookup(resolve("llama-3.1-8b"), "cuda", "bfloat16")
    if base is None:
        row("dependent launch: greedy tokens", "skipped: no static-best recorded for the 8B on this device")
        return True

    ok = True
    prompts = _prompts(b, ctx)
    for label, spec in (("bf16", base), ("fp8", quantized_variant(base, "fp8", "cuda"))):
        ref = None
        for pdl in (0, 1, 2):
            eng.apply_variant(launched(spec, pdl))  # pdl 0: every kernel launched as without it
            eng.block_manager.reset_prefix_cache()
            got = [o.token_ids for o in eng.generate(prompts, SamplingParams(max_tokens=new, ignore_eos=True))]
            if ref is None:
                ref = got
                continue
            diff = sum(x != y for r, g in zip(ref, got) for x, y in zip(r, g))
            ok &= diff == 0
            row(f"{label} + pdl {pdl}: greedy tokens of {b} sequences x {new} against pdl 0",
                "equal" if diff == 0 else f"DIFFER: {diff} of {b * new} tokens")
    eng.apply_variant(base)
    return ok
