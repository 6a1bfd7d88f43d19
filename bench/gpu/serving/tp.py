"""Tensor parallelism over two GPUs (NCCL): correctness against one GPU first, then throughput.

    python -m bench gpu.serving.tp [--out DIR] [--trace CSV] [--requests N]

1. Correctness, float32, Llama-3.1-8B shape cut to 4 layers, synthetic weights (the same on every
   rank, from the seed): greedy tokens of 4 prompts and the first step's logits, TP=2 against TP=1,
   with the reference kernels and with Triton kernels + CUDA graphs (the all-reduces captured).
2. bf16, the whole 8B shape, Triton kernels + CUDA graphs: batch-1 decode tokens/s, and offline
   throughput on the Azure conversation trace's request lengths, TP=2 against TP=1.

Each configuration runs in fresh processes (one per rank), so no run inherits another's memory.
Rows go to DIR/gpu_tp.jsonl as they are measured, the table to DIR/gpu_tp.json.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from bench.gpu import harness as gb
from bench.gpu.harness import row
from bench.gpu.serving.throughput import trace_requests
from engine.config.presets import TRITON_ALL, TRITON_GEMV
from bench.lib import cli

ROOT = Path(__file__).resolve().parents[3]
TRITON = {**TRITON_ALL, **TRITON_GEMV}
ATTN = {"attention": {"block_n": 128, "num_warps": 8}}


MODEL, DEVICE = "llama-3.1-8b", "cuda"  # a smaller model and "cpu" (gloo) only to try the script itself


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _engine(rank: int, tp: int, dtype: str, layers: int | None, spec_json: dict, blocks: int):
    from engine import EngineConfig, LLMEngine, resolve
    from engine.model.parallel import rank_device
    from engine.config.variant import VariantSpec

    spec = VariantSpec.from_json({**spec_json, "tp": tp})
    return LLMEngine(EngineConfig(source=resolve(MODEL, synthetic=True, seed=0), device=rank_device(DEVICE, rank),
                                  dtype=dtype, layers=layers, num_kv_blocks=blocks, load_tokenizer=False,
                                  variant=spec))


def check_job(rank: int, tp: int, spec_json: dict) -> dict:
    """fp32, 4 layers: greedy tokens of 4 prompts and the logits of the first two steps."""
    from engine import SamplingParams

    eng = _engine(rank, tp, "float32", 4, spec_json, 256)
    seen = []
    eng.logits_sink = lambda ids, logits: seen.append(logits.float().cpu())
    gen = torch.Generator().manual_seed(1)
    vocab = eng.model_config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (7, 40, 129, 300)]
    tokens = [o.token_ids for o in eng.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))]
    return {"tokens": tokens, "logits": [t[:, :4096].tolist() for t in seen[:2]]}  # a slice keeps the reply small


def decode_job(rank: int, tp: int, spec_json: dict) -> dict:
    from engine import SamplingParams

    eng = _engine(rank, tp, "bfloat16", None, spec_json, 512)
    prompt, new = list(range(1, 129)), 128
    eng.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))  # warm
    best = 0.0
    for _ in range(2):
        eng.add_request(prompt, SamplingParams(max_tokens=new, ignore_eos=True))
        eng.step()
        _sync()
        t = time.perf_counter()
        while eng.has_unfinished():
            eng.step()
        _sync()
        best = max(best, (new - 1) / (time.perf_counter() - t))
    return {"tps": best, "weights_gb": sum(p.numel() * p.element_size() for p in eng.model.parameters()) / 1e9}


def throughput_job(rank: int, tp: int, spec_json: dict, reqs: list) -> dict:
    from engine import SamplingParams

    blocks = sum(-(-(i + o) // 16) for i, o in reqs) + 64
    eng = _engine(rank, tp, "bfloat16", None, spec_json, blocks)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, eng.model_config.vocab_size, (i,), generator=gen).tolist() for i, _ in reqs]
    params = [SamplingParams(max_tokens=o, ignore_eos=True) for _, o in reqs]
    eng.generate([prompts[0][:32]], SamplingParams(max_tokens=4, ignore_eos=True))  # prefill kernels JIT
    _sync()
    t = time.perf_counter()
    outs = eng.generate(prompts, params)
    _sync()
    secs = time.perf_counter() - t
    return {"seconds": secs, "out_tokens": sum(len(o.token_ids) for o in outs)}


def run(tp: int, job, *args) -> dict:
    from engine.model.parallel import run_ranks

    return run_ranks(tp, DEVICE, _with_globals, MODEL, DEVICE, job, tp, *args)


def _with_globals(rank: int, model: str, device: str, job, *args) -> dict:
    global MODEL, DEVICE  # spawned ranks start from the module's defaults
    MODEL, DEVICE = model, device
    return job(rank, *args)


def add_cli_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", type=Path, default=Path("/tmp"))
    ap.add_argument("--trace", type=Path, default=ROOT / "bench" / "data" / "azure_conv_400.csv")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--skip-check", action="store_true", help="throughput only (the check passed in an earlier run)")
    ap.add_argument("--model", default=MODEL, help=argparse.SUPPRESS)
    ap.add_argument("--device", default=DEVICE, help=argparse.SUPPRESS)


def main(args: argparse.Namespace) -> int | None:
    global MODEL, DEVICE
    MODEL, DEVICE = args.model, args.device
    gb.OUT, gb.LOG = args.out, "gpu_tp"
    args.out.mkdir(parents=True, exist_ok=True)
    if DEVICE == "cuda":
        assert torch.cuda.device_count() >= 2, "this benchmark needs two GPUs"
        row("devices", f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()} torch {torch.__version__}")
    ok = True
    for label, spec in () if args.skip_check else (("Triton + GEMV + CUDA graphs", {"kernels": TRITON, "kernel_params": ATTN,
                                                         "cuda_graph_batch_sizes": [1, 2, 4, 8]}),):
        one, two = run(1, check_job, spec), run(2, check_job, spec)
        same = one["tokens"] == two["tokens"]
        err = max((torch.tensor(a) - torch.tensor(b)).abs().max().item() for a, b in zip(one["logits"], two["logits"]))
        scale = max(torch.tensor(a).abs().max().item() for a in one["logits"])
        ok &= same and err < 1e-3 * scale
        row(f"TP=2 vs TP=1, fp32 8B shape (4 layers), {label}",
            f"greedy tokens (4 prompts x 16) {'equal' if same else 'DIFFER'}; logits max abs diff {err:.2e} (first 4,096 of the vocabulary) "
            f"(|logits| {scale:.2f}) -> {'OK' if same and err < 1e-3 * scale else 'MISMATCH'}")
    if not ok:
        row("throughput", "skipped: TP=2 does not match TP=1")
    else:
        fast = {"kernels": TRITON, "kernel_params": ATTN, "cuda_graph_batch_sizes": [1, 2, 4, 8]}
        d1, d2 = run(1, decode_job, fast), run(2, decode_job, fast)
        row("8B bf16 decode b=1, Triton + GEMV + graphs: TP=1 / TP=2 tok/s",
            f"{d1['tps']:.1f} / {d2['tps']:.1f} = {d2['tps'] / d1['tps']:.2f}x (weights per GPU {d1['weights_gb']:.1f} / "
            f"{d2['weights_gb']:.1f} GB)")
        reqs = trace_requests(args.trace, args.requests, 2048, 256)
        batch = {**fast, "max_num_seqs": 128, "max_num_batched_tokens": 8192,
                 "cuda_graph_batch_sizes": [1, 2, 4, 8, 16, 32, 48, 64, 96, 128]}
        t1, t2 = run(1, throughput_job, batch, reqs), run(2, throughput_job, batch, reqs)
        out = sum(o for _, o in reqs)
        assert t1["out_tokens"] == t2["out_tokens"] == out
        row(f"8B bf16 offline, {len(reqs)} Azure-conv requests (in<=2048, out<=256): TP=1 / TP=2",
            f"{t1['seconds']:.2f} s / {t2['seconds']:.2f} s = {out / t1['seconds']:,.0f} / {out / t2['seconds']:,.0f} "
            f"output tok/s = {t1['seconds'] / t2['seconds']:.2f}x")
    gb.finish()


if __name__ == "__main__":
    sys.exit(cli.run(__doc__, add_cli_args, main))
