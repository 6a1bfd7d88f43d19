"""8. Weight precision on the 8B shape (random bf16 weights): the quantized kernels against the float64 product
first, then batch-1 decode with int8 and FP8 (e4m3) weights against bf16, each against the roofline of its own
bytes, and prefill throughput with each (FP8: the tensor-core GEMM; int8: the weights dequantized per call).
On synthetic weights the numerical error is the evidence (the gates judge real weights)."""
from __future__ import annotations

import dataclasses
import time
import traceback

import torch

from bench.gpu.harness import Llama8B, decode_tps, graph_timed, row, section
from engine.config.presets import preset_variant

KINDS = ("auto", "int8", "fp8")


@section
def quantized_kernel_checks() -> bool:
    """Each path of the quantized linear against the float64 product of the dequantized weights."""
    from kernels.linear.linear_triton import act_linear_triton, linear_triton, norm_linear_triton
    from kernels.linear.quant import qlinear, qlinear_exact, quantize

    ok = True
    torch.manual_seed(1)
    for kind in ("int8", "fp8"):
        for n, k in ((4096, 4096), (28672, 4096), (4096, 14336)):
            qw = quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, kind)
            worst = 0.0
            for m in (1, 3, 5, 17, 300):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                exact = qlinear_exact(x, qw)
                scale = exact.abs().max().item()
                for label, fn in (("gemv", lambda: linear_triton(x, qw, max_m=4)), ("torch", lambda: qlinear(x, qw))):
                    try:
                        err = (fn().double() - exact).abs().max().item() / scale
                    except Exception as e:
                        row(f"quantized linear {kind} {n}x{k} rows {m} [{label}]", f"FAILED {type(e).__name__}: {e}")
                        ok = False
                        continue
                    worst = max(worst, err)
                    # bf16 output (8 bits); FP8: the GEMM's e4m3 activations (1/16 relative per element), which
                    # the GEMV path takes too where the per-shape timing chose the GEMM
                    limit = 0.05 if kind == "fp8" else 0.01
                    if err > limit:
                        row(f"quantized linear {kind} {n}x{k} rows {m} [{label}]", f"error {err:.3g} > {limit}")
                        ok = False
            row(f"quantized linear {kind} {n}x{k}, rows 1-300, GEMV and torch paths", f"worst error {worst:.3g} of "
                "the output's scale")
        r, nw = torch.randn(2, 4096, device="cuda", dtype=torch.bfloat16), torch.randn(4096, device="cuda",
                                                                                        dtype=torch.bfloat16)
        qw = quantize(torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * 0.02, kind)
        x = torch.randn(2, 4096, device="cuda", dtype=torch.bfloat16)
        from kernels.pointwise.norm import fused_add_rms_norm_ref

        h, _ = fused_add_rms_norm_ref(x, r, nw, 1e-5)
        e1 = (norm_linear_triton(x, r, nw, 1e-5, qw)[0].double() - qlinear_exact(h, qw)).abs().max().item()
        gu = torch.randn(2, 8192, device="cuda", dtype=torch.bfloat16)
        from kernels.pointwise.activation import silu_and_mul_ref

        e2 = (act_linear_triton(gu, qw).double() - qlinear_exact(silu_and_mul_ref(gu), qw)).abs().max().item()
        row(f"quantized norm_linear / act_linear {kind} (fused prologues)", f"max abs error {e1:.3g} / {e2:.3g}")
    row("quantized kernels correct", str(ok))
    return ok


@section
def gemv_bandwidth_by_precision(bw: float) -> None:
    """The decode GEMV on the 8B's MLP up-projection at batch 1: bytes over time, against the copy bandwidth."""
    from kernels.linear.linear_triton import linear_triton
    from kernels.linear.quant import quantize

    w = torch.randn(28672, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    for kind in KINDS:
        wt = w if kind == "auto" else quantize(w, kind)
        nbytes = w.numel() * (2 if kind == "auto" else 1)
        linear_triton(x, wt)  # autotune, and the per-shape choice against torch
        t = graph_timed(lambda: linear_triton(x, wt))
        row(f"GEMV 28672x4096 b=1, {kind if kind != 'auto' else 'bf16'} weights",
            f"{1e6 * t:.1f} us = {nbytes / t / 1e9:,.0f} GB/s ({100 * nbytes / t / bw:.0f}% of copy bw; the weights "
            "exceed the L2, so each call streams them from HBM)")


def _logits(eng, prompt) -> torch.Tensor:
    """The logits of the prompt's last position (the first sampled token's)."""
    from engine import SamplingParams

    sink = []
    eng.logits_sink = lambda ids, logits: sink.append(logits.float().clone())
    try:
        eng.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
    finally:
        eng.logits_sink = None
    return sink[0][-1]


def prefill_seconds(eng, prompts) -> float:
    """Seconds to prefill ``prompts`` (one output token each), the second of two runs (the first compiles and
    tunes the kernels of its shapes), the prefix cache emptied before each."""
    from engine import SamplingParams

    for _ in range(2):
        eng.block_manager.reset_prefix_cache()
        torch.cuda.synchronize()
        t = time.perf_counter()
        eng.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
    eng.block_manager.reset_prefix_cache()
    return dt


@section
def llama8b_precision(m: Llama8B, bw: float, prefill: bool = True, profile: bool = True):
    from engine import SamplingParams
    from engine.model.precision import dense_weights, quantized_bytes

    eng = m.engine
    prompt, new = list(range(1, 129)), 128
    kv_bytes = m.mcfg.kv_bytes_per_token(2) * (len(prompt) + new / 2)
    checkpoint_dense = sum(w.numel() * w.element_size() for w in dense_weights(eng.model))
    other = m.weight_bytes - m.embed_bytes - checkpoint_dense  # norms (and a tied head would count once)
    # batch 1 only: one graph, and the GEMV tiles autotuned for one row
    base_form = preset_variant("dense-decode", m.mcfg.hidden_size, base=eng.variant, cuda_graph_batch_sizes=(1,))
    eng.config = dataclasses.replace(eng.config, async_decode=True)
    results, ref_logits = {}, None
    for kind in KINDS:
        spec = dataclasses.replace(base_form, weight_dtype=kind)
        try:
            t = time.perf_counter()
            eng.apply_variant(spec)
            swap = time.perf_counter() - t
            eng.block_manager.reset_prefix_cache()
            dense = checkpoint_dense if kind == "auto" else quantized_bytes(eng.model, kind)
            step_bytes = dense + other + kv_bytes  # the embedding table not counted: one row is read
            roofline = bw / step_bytes
            eng.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))
            tps = max(decode_tps(eng, prompt, new) for _ in range(2))
            logits = _logits(eng, prompt)
        except Exception as e:
            traceback.print_exc()
            row(f"8B decode b=1, {kind} weights", f"FAILED {type(e).__name__}: {str(e)[:200]}")
            continue
        if ref_logits is None:
            ref_logits = logits
        err = (logits - ref_logits).abs().max().item()
        kl = torch.nn.functional.kl_div(logits.log_softmax(-1), ref_logits.log_softmax(-1), log_target=True,
                                        reduction="sum").item()
        results[kind] = tps
        label = "bf16" if kind == "auto" else kind
        row(f"8B decode b=1, dense-decode + graphs, {label} weights ({dense / 1e9:.2f} GB dense)",
            f"{tps:.1f} tok/s = {100 * tps / roofline:.1f}% of its own roofline ({roofline:.0f} tok/s); "
            f"{tps / results['auto']:.2f}x bf16 (swap in {swap:.1f} s, quantizing included once); last-position "
            f"logits vs bf16: max |d| {err:.3g}, KL {kl:.3g} (max |logit| {ref_logits.abs().max():.2f})"
            if "auto" in results else f"{tps:.1f} tok/s")
    if profile and "fp8" in results:  # where an FP8 step's time goes, against the bf16 step's
        from bench.gpu.harness import kernel_profile

        for kind in ("auto", "fp8"):
            eng.apply_variant(dataclasses.replace(base_form, weight_dtype=kind))
            graph, _ = eng.runner.graphs.graphs[1]
            kernel_profile(f"8B decode step, {'bf16' if kind == 'auto' else kind} weights", graph.replay, top=8)
    if prefill:
        # the prefill form of the throughput section (paged attention): prompts of 2,048 tokens in 8,192-token
        # steps, each measured after the same batch ran once (the kernels of its shapes compiled and tuned)
        n_p, length = 8, 2048
        gen = torch.Generator().manual_seed(0)
        pp = [torch.randint(0, 128000, (length,), generator=gen).tolist() for _ in range(n_p)]
        prefill_form = preset_variant("triton-paged", max_num_seqs=64, max_num_batched_tokens=8192)
        rates = {}
        for kind in KINDS:
            try:
                eng.apply_variant(dataclasses.replace(prefill_form, weight_dtype=kind))
                dt = prefill_seconds(eng, pp)
            except Exception as e:
                traceback.print_exc()
                row(f"8B prefill, {kind} weights", f"FAILED {type(e).__name__}: {str(e)[:200]}")
                continue
            rates[kind] = n_p * length / dt
            label = "bf16" if kind == "auto" else kind + (" (FP8 tensor-core GEMM, e4m3 activations per row)"
                                                          if kind == "fp8" else " (weights dequantized per call)")
            row(f"8B prefill {n_p} x {length} tokens, 8192-token steps, {label}",
                f"{rates[kind]:,.0f} tok/s" + (f" = {rates[kind] / rates['auto']:.2f}x bf16" if "auto" in rates else ""))
    eng.apply_variant(dataclasses.replace(base_form, cuda_graph_batch_sizes=()))
    return results
