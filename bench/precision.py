"""Weight precision on real weights: batch-1 decode of SmolLM2 (or any model) with the checkpoint's weights and
with int8 (and FP8) weights, measured in alternation within one run, and each precision's gate verdict.

Each form answers the same chat prompts greedily at batch 1 (--rounds alternating rounds: auto, int8, ...,
auto, int8, ...); the decode rate is output tokens over the time after the first token (the prefill
excluded). Then the quality and contamination gates judge each quantized form against the reference
variant with the precision's own thresholds (checks/report.py). The table gives tokens/s (median over
rounds), the ratio to the checkpoint's precision in the same run, the bytes of the dense weights a decode
step reads, and the gate's figures.

    .venv/bin/python -m bench precision                       # SmolLM2 on the CPU, int8
    .venv/bin/python -m bench precision --kinds int8 fp8      # FP8 too (dequantized on a CPU: slow)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from bench.lib import cli
from bench.lib.timing import alternate, decode_rate

ROOT = Path(__file__).resolve().parents[1]

PROMPTS = ["Tell a short story about a lighthouse keeper who finds a message in a bottle.",
           "What are three good habits for writing maintainable software? Explain each briefly.",
           "Why is the sky blue? Explain it to a curious ten-year-old."]


def add_cli_args(ap: argparse.ArgumentParser) -> None:
    cli.add_model_args(ap)
    ap.add_argument("--kinds", nargs="+", default=["int8"], choices=["int8", "fp8"])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-gate", action="store_true", help="skip the gates (speed only)")
    ap.add_argument("--json", type=Path, help="also write the figures here")


def main(args: argparse.Namespace) -> int:

    from checks.gates import gate_variant
    from engine import EngineConfig, LLMEngine, SamplingParams, VariantSpec, resolve
    from engine.model.precision import dense_weights, quantized_bytes

    base = LLMEngine(EngineConfig(source=resolve(args.model), device=args.device, dtype=args.dtype, num_kv_blocks=8))
    kinds = ["auto", *args.kinds]
    engines = {k: LLMEngine.with_loaded(base, EngineConfig(
        source=resolve(args.model), device=args.device, dtype=args.dtype, num_kv_blocks=256,
        variant=VariantSpec(max_num_seqs=1, weight_dtype=k))) for k in kinds}
    for eng in engines.values():  # warm-up (and the quantization, once per precision)
        eng.generate(["Hello"], SamplingParams(max_tokens=4))
    texts = [base.encode_prompt(p, chat=base.tokenizer is not None) for p in PROMPTS]
    def rate(eng) -> float:
        runs = [decode_rate(eng, text, args.max_tokens) for text in texts]
        return sum(n for n, _ in runs) / sum(s for _, s in runs)

    rates = alternate({k: (lambda eng=eng: rate(eng)) for k, eng in engines.items()}, args.rounds)
    checkpoint_bytes = sum(w.numel() * w.element_size() for w in dense_weights(base.model))
    rows = []
    off = statistics.median(rates["auto"])
    for k in kinds:
        row = {"weights": k, "tok_s": statistics.median(rates[k]), "spread": max(rates[k]) - min(rates[k]),
               "ratio": statistics.median(rates[k]) / off,
               "dense_mb": (checkpoint_bytes if k == "auto" else quantized_bytes(base.model, k)) / 1e6}
        if k != "auto" and not args.no_gate:
            rep = gate_variant(base, VariantSpec(weight_dtype=k), max_tokens=12, fail_fast=False)
            row.update(verdict=rep.verdict, agreement=rep.greedy_agreement, max_dlogit=rep.max_abs_logit_delta,
                       mean_kl=rep.mean_kl, reasons=rep.reasons)
        rows.append(row)
    head = f"{'weights':8} {'tok/s':>7} {'spread':>7} {'vs ckpt':>8} {'dense MB':>9}  gate"
    print(head)
    print("-" * len(head))
    for r in rows:
        gate = ("-" if "verdict" not in r else f"{r['verdict']}: agreement {r['agreement']:.3f}, max |dlogit| "
                f"{r['max_dlogit']:.3g}, mean KL {r['mean_kl']:.3g}")
        print(f"{r['weights']:8} {r['tok_s']:7.2f} {r['spread']:7.2f} {r['ratio']:7.2f}x {r['dense_mb']:9.1f}  {gate}")
    print(f"model {args.model}, {args.device} {args.dtype}, batch 1, greedy, {args.max_tokens} tokens per answer "
          f"(decode only), {len(PROMPTS)} prompts, median of {args.rounds} alternating rounds")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(__doc__, add_cli_args, main))
