"""The GPU benchmark's run: correctness first, then the figures, then one table (the sections' order and
options; bench/gpu/suite.py is the command)."""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from bench.gpu import harness
from bench.gpu.correctness import kernel_checks, tiny_models_vs_transformers
from bench.gpu.decode import llama8b_decode
from bench.gpu.experts import experts_alone
from bench.gpu.harness import GRAPH_SIZES, ROOT, Llama8B, finish, row, section
from bench.gpu.machine import attention_bandwidth, gemv_bandwidth, l2_survival, machine
from bench.gpu.moe import moe_decode
from bench.gpu.precision.kv_fp8 import fp8_kv_cache
from bench.gpu.precision.prefill import (decode_attention_kernels, prefill_attention_kernels, w8a8_checks,
                                        w8a8_gemm_accum, w8a8_prefill, w8a8_projections, w8a8_quant_passes,
                                        w8a8_served, w8a8_host_cost, w8a8_ttft)
from bench.gpu.precision.weights import gemv_bandwidth_by_precision, llama8b_precision, quantized_kernel_checks
from bench.gpu.precision.serve import activation_quant_checks, pdl_tokens, served_decode_by_precision
from bench.gpu.precision.step import decode_forms_by_precision, projections_alone
from bench.gpu.precision.qmma import qmma_checks, qmma_decode, qmma_projections, qmma_served, qmma_step_tiles, qmma_sweep
from bench.gpu.serving.swap import cold_start_and_swap, cold_start_child
from bench.gpu.serving.throughput import llama8b_throughput
from bench.lib.tiles import tiles_kept
from engine.config.presets import preset_variant

SECTIONS = ("attention", "gemv", "decode", "throughput", "swap", "moe", "experts", "precision", "precision-step",
            "kv-fp8", "precision-serve", "qmma", "w8a8", "w8a8-ttft", "w8a8-host", "pdl-tokens")  # --only


def add_cli_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", type=Path, default=Path("/tmp"))
    ap.add_argument("--only", default="", help=f"comma-separated: {','.join(SECTIONS)}")
    ap.add_argument("--trace", type=Path, default=ROOT / "bench" / "data" / "azure_conv_400.csv")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--hf-batch", type=int, default=32)
    ap.add_argument("--decode-quick", action="store_true",
                    help="8B decode: only the five best forms, without the transformers rows")
    ap.add_argument("--skip-checks", action="store_true",
                    help="skip section 1 (kernels and tiny models against their references), for a second call on "
                         "the same commit (the precision section still checks its own kernels)")
    ap.add_argument("--decode-only", action="store_true",
                    help="precision: the decode rows only (no kernel checks, profile or prefill), for a warm machine")
    ap.add_argument("--step-quick", action="store_true",
                    help="precision-step: each precision in the dense-decode form only (no other forms, no tile sweep)")
    ap.add_argument("--step-fp8-sweep", action="store_true",
                    help="precision-step: bf16 and FP8 in the dense-decode form only, then FP8's per-op tiles timed in "
                         "the whole step")
    ap.add_argument("--qmma-model-only", action="store_true",
                    help="qmma: skip the kernel checks and projections (a second call on the same commit)")
    ap.add_argument("--qmma-no-served", action="store_true", help="qmma: batch-1 decode only, no served steps")
    ap.add_argument("--qmma-no-projections", action="store_true",
                    help="qmma: the kernel checks, but not each projection timed alone")
    ap.add_argument("--w8a8-ttft-quick", action="store_true",
                    help="w8a8-ttft: bf16, fp8 and fp8 with prefill graphs only, prompts of 512-2,048 tokens")
    ap.add_argument("--w8a8-served-only", action="store_true",
                    help="w8a8: the decode steps as served only (static-best bf16, its FP8 form, and the FP8 form with "
                         "the W8A8 GEMM from 32 rows), no kernel sections and no prefill")
    ap.add_argument("--w8a8-no-projections", action="store_true",
                    help="w8a8: the checks, the prefill attention kernel and the model figures, but not each "
                         "projection timed alone")
    ap.add_argument("--qmma-sweep", action="store_true",
                    help="qmma: each projection's tiles and K splits timed at batch 1 (FP8), then the quick decode "
                         "(bf16, FP8, int8 as the tuner splits them, three rounds, each ratio against its round's bf16)")
    ap.add_argument("--qmma-quick", action="store_true",
                    help="qmma: the quick decode (as with --qmma-sweep) without the projections' sweep")
    ap.add_argument("--qmma-pin", action="store_true",
                    help="qmma: the quick decode's rounds also with gate_up's tiles pinned (qmma.GATE_UP_TILES)")
    ap.add_argument("--qmma-step-tiles", action="store_true",
                    help="qmma: batch-1 FP8 decode with the GEMV's tiles timed in the whole step (qmma_step_tiles) "
                         "instead of the quick decode (with --qmma-sweep: without the tiles' sweep)")
    ap.add_argument("--kv-length", type=int, default=32000, help="kv-fp8: the long prompts' length in tokens")
    ap.add_argument("--kv-batches", default="1,4", help="kv-fp8: the batch sizes decoded at that length")
    ap.add_argument("--moe-layers", type=int, default=None)
    ap.add_argument("--moe-sweep", action="store_true", help="MoE: also sweep the experts' tiles at batch 1")
    ap.add_argument("--cold-start", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--t0", type=float, default=None, help=argparse.SUPPRESS)


def main(args: argparse.Namespace) -> None:
    if args.cold_start:
        cold_start_child(args.cold_start, args.variant, args.t0)
        return
    harness.OUT = args.out
    args.out.mkdir(parents=True, exist_ok=True)
    with tiles_kept(args.out):  # the tiles autotuned here, kept as OUT/tile-table.json
        _sections(args)


def _sections(args: argparse.Namespace) -> None:
    only = set(filter(None, args.only.split(",")))
    want = lambda s: not only or s in only  # noqa: E731
    assert torch.cuda.is_available(), "this benchmark needs a GPU"
    row("device", f"{torch.cuda.get_device_name()} torch {torch.__version__}")
    tmp = Path(tempfile.mkdtemp(prefix="polyinf_bench_"))
    ok = args.skip_checks or kernel_checks()
    ok2 = args.skip_checks or tiny_models_vs_transformers(tmp)
    if want("precision") and not args.decode_only:
        quantized_kernel_checks()  # its rows say what failed; the model figures then show the same failures
    bw, peak = machine() or (4.27e12, 700e12)
    if want("attention"):
        attention_bandwidth()
    if want("gemv") or want("decode"):
        gemv_bandwidth(bw)
    if want("precision"):
        gemv_bandwidth_by_precision(bw)
    if want("precision-step"):
        projections_alone()
    if want("precision-serve"):
        activation_quant_checks()
    if want("qmma") and not args.qmma_model_only:
        ok = qmma_checks() and ok
        if not args.qmma_no_projections:
            qmma_projections()
        if args.qmma_sweep:
            qmma_sweep()
    if want("w8a8") and not args.w8a8_served_only:
        w8a8_checks()  # its rows say what failed; the model figures go on (they print their own logit error)
        w8a8_quant_passes()
        w8a8_gemm_accum()
        prefill_attention_kernels()
        decode_attention_kernels()
        if not args.w8a8_no_projections:
            w8a8_projections()
    if want("kv-fp8"):  # the decode attention kernel alone over each cache, short and long contexts
        decode_attention_kernels()
        decode_attention_kernels(4, 32000)
    if want("w8a8-host"):  # no model load: the host's cost per launch, then the codes' kernels and their tiles
        w8a8_host_cost()
        w8a8_quant_passes()
    if want("decode") or want("moe"):
        l2_survival()
    if not (ok and ok2):
        row("model figures", "skipped: correctness checks failed")
    else:
        if any(want(s) for s in ("decode", "throughput", "swap", "precision", "precision-step", "kv-fp8",
                                        "precision-serve", "qmma", "w8a8", "w8a8-ttft", "pdl-tokens")):
            m = section(Llama8B)()
            if m is not None:
                if want("precision"):
                    llama8b_precision(m, bw, prefill=not args.decode_only, profile=not args.decode_only)
                if want("precision-step"):
                    if args.step_fp8_sweep:
                        decode_forms_by_precision(m, kinds=("auto", "fp8"), sweep=("fp8",), forms=1, budget_s=260.0)
                    else:
                        decode_forms_by_precision(m, sweep=() if args.step_quick else ("auto", "fp8"))
                if want("precision-serve"):
                    served_decode_by_precision(m, args.out)
                if want("qmma") and args.qmma_step_tiles:
                    qmma_step_tiles(m, sweep=not args.qmma_sweep)
                elif want("qmma"):
                    qmma_decode(m, quick=args.qmma_sweep or args.qmma_quick, pin=args.qmma_pin)
                    if not args.qmma_no_served:
                        qmma_served(m, args.out)
                if want("w8a8"):
                    if not args.w8a8_served_only:
                        w8a8_prefill(m)
                    w8a8_served(m, args.out)
                if want("pdl-tokens"):
                    pdl_tokens(m)
                if want("w8a8-ttft"):
                    w8a8_ttft(m, quick=args.w8a8_ttft_quick)
                if want("kv-fp8"):
                    fp8_kv_cache(m, bw, args.kv_length, tuple(int(x) for x in args.kv_batches.split(",")),
                                 check=not args.skip_checks)
                best = llama8b_decode(m, bw, args.decode_quick) if want("decode") else None
                if best is None and (want("throughput") or want("swap")):
                    best = preset_variant("gemv", cuda_graph_batch_sizes=GRAPH_SIZES)
                if want("throughput"):
                    llama8b_throughput(m, args.trace, peak, args.requests, args.hf_batch)
                if want("swap"):
                    cold_start_and_swap(m, best, tmp)
                del m
                torch.cuda.empty_cache()
        if want("moe"):
            moe_decode(bw, args.moe_layers, args.moe_sweep)
        if want("experts"):
            experts_alone()
    finish()

