"""Capacity at the SLO of static-best in each parallel layout, served, on the Azure conversation and Mooncake slices.

For each slice: static-best replayed in this process (the tuner's usual slow tier), then static-best served in each
layout given (``--layouts 1x1 2x1 1x2``: tp x dp; ops/bench.served_tier: the layout started on loopback and timed,
the slice replayed over HTTP in real time, capacity searched from the same guess). Ratios are against static-best
served on one device (1x1), measured in the same run; the in-process row shows what the HTTP path costs.

    .venv/bin/python -m bench layouts --model smollm2 --layouts 1x1 1x2 --out /tmp/layouts      # this CPU
    # a two-GPU host without the web stack: carry a wheelhouse (bench/data/wheels, made here with
    # pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 ... fastapi uvicorn
    # openai prometheus-client httpx and their dependencies), then
    pip install -q --no-index --find-links bench/data/wheels --target /tmp/web fastapi uvicorn openai \\
        prometheus-client httpx && PYTHONPATH=$PWD:/tmp/web python3 -m bench layouts --model llama-3.1-8b \\
        --device cuda --dtype bfloat16 --traces bench/data --requests 64 --max-input 2048 --max-output 128 --out $OUT
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from engine import EngineConfig, LLMEngine, resolve  # noqa: E402
from engine.loader.model_source import load_config  # noqa: E402
from engine.config.static_best import lookup  # noqa: E402
from engine.config.variant import VariantSpec  # noqa: E402
from ops.measure.tiers import SLO, BenchResult, own_rate, served_tier, slow_tier  # noqa: E402
from ops.search.optimize import capacity_ratio  # noqa: E402
from ops.traffic.replay import synthesize_prompts  # noqa: E402
from ops.measure.static_best_sweep import derive_slo, unloaded_latency  # noqa: E402
from ops.traffic.traces import load_trace  # noqa: E402
from bench.lib import cli  # noqa: E402
from bench.lib.table import Table  # noqa: E402


def layout(text: str) -> tuple[int, int]:
    try:
        tp, dp = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a layout is TPxDP, e.g. 2x1; got {text!r}") from None
    if tp < 1 or dp < 1:
        raise argparse.ArgumentTypeError(f"tp and dp must be >= 1; got {text!r}")
    return tp, dp


def add_cli_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", type=Path, default=Path("/tmp/layouts"))
    cli.add_model_args(ap)
    ap.add_argument("--traces", type=Path, default=ROOT / "traces", help="a folder with the Azure and Mooncake traces")
    ap.add_argument("--only", nargs="*", default=["azure", "mooncake"])
    ap.add_argument("--layouts", type=layout, nargs="+", default=[(1, 1), (2, 1), (1, 2)])
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--max-input", type=int, default=256)
    ap.add_argument("--max-output", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2, help="replays per rate (a rate passes only if every one does)")
    ap.add_argument("--probes", type=int, default=5, help="rates the capacity search may replay")
    ap.add_argument("--num-kv-blocks", type=int, default=1024)


def main(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    source = resolve(args.model)
    base = lookup(source, args.device, args.dtype) or VariantSpec(name="default (no static-best recorded)")
    vocab = load_config(source).vocab_size
    table = Table(args.out / "rows.jsonl", width=64)
    row = table.row

    def cfg(v: VariantSpec) -> EngineConfig:
        return EngineConfig(source=source, device=args.device, dtype=args.dtype, num_kv_blocks=args.num_kv_blocks,
                            variant=v, load_tokenizer=False)

    row("static-best", f"{base.name} ({base.variant_id})")
    slices = {"azure": next(iter(sorted(args.traces.glob("*zure*conv*")))),
              "mooncake": next(iter(sorted(args.traces.glob("*ooncake*"))))}
    for name in args.only:
        records = load_trace(slices[name])[: args.requests]
        prompts = synthesize_prompts(records, vocab, max_input=args.max_input)
        engine = LLMEngine(cfg(base))
        slo = derive_slo(unloaded_latency(engine, prompts, args.max_output))
        row(f"{name}: SLO", f"TTFT {1e3 * slo.ttft_s:.0f} ms, TPOT {1e3 * slo.tpot_s:.0f} ms (derived from static-best)")
        got: dict[str, BenchResult] = {}
        kw = dict(repeats=args.repeats, time_scale=1.0, max_output=args.max_output, slo=SLO(slo.ttft_s, slo.tpot_s),
                  capacity_guess=own_rate(records), capacity_probes=args.probes)
        try:
            got["in-process"] = slow_tier(engine, records, prompts, name, **kw)
        except Exception as e:
            traceback.print_exc()
            row(f"{name}: in-process FAILED", f"{type(e).__name__}: {e}")
        del engine
        for tp, dp in args.layouts:
            label = f"tp {tp} x dp {dp}"
            t = time.time()
            try:
                got[label] = served_tier(cfg(dataclasses.replace(base, tp=tp, dp=dp)), records, prompts, name, **kw)
            except Exception as e:
                traceback.print_exc()
                row(f"{name}: {label} FAILED", f"{type(e).__name__}: {str(e)[:200]}")
                continue
            print(f"[{label}: {time.time() - t:.0f} s]", flush=True)
        ref = got.get("tp 1 x dp 1")
        for label, r in got.items():
            ratio = ""
            if ref is not None and label != "tp 1 x dp 1":
                x, lo, hi = capacity_ratio(r, ref)
                ratio = f"; {x:.2f}x static-best served on one device (range {lo:.2f}-{hi:.2f}x)"
            row(f"{name}: {label}", f"capacity {r.capacity:.3f} req/s (bracket {r.capacity_spread:.3f}), "
                                    f"{r.output_tok_s:.1f} tok/s, TTFT p50 {1e3 * r.ttft_p50:.0f} ms, TPOT p50 "
                                    f"{1e3 * r.tpot_p50:.1f} ms" + (f", started in {r.start_s:.1f} s" if r.start_s else "")
                                    + ratio)
        (args.out / f"{name}.json").write_text(json.dumps({k: v.to_json() for k, v in got.items()}, indent=2))
    print("\n" + table.markdown())
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(__doc__, add_cli_args, main))
