"""The quality and contamination gates on a GPU for the kernel variants the tuner picks, in float32
and bfloat16, on a Llama-3.1-8B-shaped model with synthetic weights (a few layers): tells numeric
divergence of bf16 from contamination (which float32 would show too).

    PYTHONPATH=$PWD python3 -m bench gpu.gates [--layers 4] [--model qwen3-30b-a3b]
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from checks.gates import gate_variant  # noqa: E402
from engine import EngineConfig, LLMEngine, resolve  # noqa: E402
from engine.config.presets import preset_variant  # noqa: E402
from engine.config.variant import REFERENCE_VARIANT  # noqa: E402
from bench.lib import cli  # noqa: E402


def add_cli_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--only", default="", help="gate only the variants whose name contains this text")


def main(args: argparse.Namespace) -> int:
    graphs = (1, 2, 4, 8, 16, 32)
    # the validated forms of engine/config/presets.py (each gated on either model; the MoE form with its whole-row tiles
    # sized to the MoE shape's hidden 2,048, as measured best there)
    forms = {"triton": "triton", "triton + graphs": "triton-paged",
             "triton + graphs + GEMV + split-KV": "gemv-split-kv", "... + dependent launch (pdl 1)": "gemv-split-kv-pdl",
             "... + dependent launch (pdl 1) + rotary_attention (dense-decode)": "dense-decode",
             "... + dependent launch, rotary_attention, whole-row tiles, sum in down, activation in gate/up, o_proj "
             "and next QKV prefetch (moe-decode)": "moe-decode"}
    variants = {"reference (against itself)": REFERENCE_VARIANT,
                **{label: preset_variant(name, 2048, cuda_graph_batch_sizes=() if name == "triton" else graphs)
                   for label, name in forms.items()}}
    variants = {name: v for name, v in variants.items() if args.only in name}
    rows = []
    for dtype in args.dtypes:
        base = LLMEngine(EngineConfig(source=resolve(args.model), device=args.device, dtype=dtype, layers=args.layers,
                                      num_kv_blocks=512, load_tokenizer=False))
        for name, v in variants.items():
            t = time.perf_counter()
            try:
                rep = gate_variant(base, dataclasses.replace(v, name=name))
                print(rep.summary(), flush=True)
                verdict = rep.verdict
                why = "; ".join(rep.reasons)[:400] or (
                    f"agreement {rep.greedy_agreement:.3f} ({rep.excused_ties} ties excused, reference batch noise "
                    f"{rep.tie_margin / 2:.3g}), free-running {rep.free_running_agreement:.3f}, "
                    f"max |dlogit| {rep.max_abs_logit_delta:.3g}, mean KL {rep.mean_kl:.2g}")
            except Exception as e:  # noqa: BLE001 — a crash is a finding, print it and go on
                verdict, why = "error", f"{type(e).__name__}: {e}"[:400]
            rows.append((dtype, name, verdict, why, time.perf_counter() - t))
            print(f"{dtype:9} {name:28} {verdict:5} {rows[-1][4]:6.1f} s  {why}", flush=True)
        del base
    print("\n| dtype | variant | verdict | reasons, or the quality figures |\n|---|---|---|---|")
    for dtype, name, verdict, why, _ in rows:
        print(f"| {dtype} | {name} | {verdict} | {why or '-'} |")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(__doc__, add_cli_args, main))
