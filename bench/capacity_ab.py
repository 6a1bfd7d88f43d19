"""Capacity at the SLO of static-best against one change to it, measured in alternation (A B A B ...) on the
slow tier, so that a gain a search reported can be checked apart from the search that found it.

Each round measures both forms with the same slice, prompts and SLO (derived from static-best's unloaded
latency unless given); every rate probe replays the slice --repeats times and passes only if all replays
pass. The table gives each round's capacities with their brackets and the ratio's range from both brackets;
a range that holds 1 is no gain.

    .venv/bin/python bench/capacity_ab.py --change '{"max_num_seqs": 4}'                 # SmolLM2 on the CPU
    PYTHONPATH=$PWD python3 bench/capacity_ab.py --model llama-3.1-8b --device cuda --dtype bfloat16 \\
        --trace bench/data/mooncake_conv_400.jsonl --requests 32 --max-input 2048 --max-output 128 \\
        --num-kv-blocks 8192 --change '{"block_size": 32}'                                # a GPU host
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ops.hardware import probe  # noqa: E402
from ops.optimize import capacity_ratio, range_holds_one  # noqa: E402
from ops.worker import SLOW, SearchConfig, Workbench, bench_from, static_best_of  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--trace", default=str(ROOT / "traces" / "AzureLLMInferenceTrace_conv.csv"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-input", type=int, default=128)
    ap.add_argument("--max-output", type=int, default=16)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--num-kv-blocks", type=int, default=1024)
    ap.add_argument("--change", required=True, help="JSON object of VariantSpec fields to change in static-best")
    ap.add_argument("--rounds", type=int, default=2, help="A/B pairs measured")
    ap.add_argument("--repeats", type=int, default=2, help="replays per rate probe (all must pass)")
    ap.add_argument("--probes", type=int, default=8, help="rate probes per capacity search")
    ap.add_argument("--slo-ttft-ms", type=float)
    ap.add_argument("--slo-tpot-ms", type=float)
    ap.add_argument("--out", type=Path, help="a JSON file for the measurements")
    args = ap.parse_args()
    try:
        change = json.loads(args.change)
        if not isinstance(change, dict):
            raise ValueError("--change must be a JSON object")
    except ValueError as e:
        ap.error(f"--change: {e}")
    cfg = SearchConfig(model=args.model, trace=args.trace, device=args.device, dtype=args.dtype,
                       requests=args.requests, max_input=args.max_input, max_output=args.max_output,
                       time_scale=args.time_scale, slow_repeats=args.repeats, capacity_probes=args.probes,
                       num_kv_blocks=args.num_kv_blocks,
                       slo_ttft_s=args.slo_ttft_ms / 1e3 if args.slo_ttft_ms else None,
                       slo_tpot_s=args.slo_tpot_ms / 1e3 if args.slo_tpot_ms else None)
    a = static_best_of(cfg)
    try:
        b = dataclasses.replace(a, name=f"static-best + {args.change}", **change)
    except Exception as e:  # an unknown field (TypeError) or a value the spec refuses (ConfigError)
        ap.error(f"--change: {type(e).__name__}: {e}")
    bench = Workbench(cfg, probe(cfg.device, size_mb=64 if cfg.device == "cpu" else 256))
    cfg = bench.with_slo(a)
    print(f"A: {a.name} ({a.variant_id}); B: {b.name} ({b.variant_id}): {b.changes_from(a)}")
    print(f"SLO: TTFT <= {1e3 * cfg.slo_ttft_s:.0f} ms, TPOT <= {1e3 * cfg.slo_tpot_s:.0f} ms ({cfg.slo_source}); "
          f"{args.requests} requests of {args.trace}, each rate replayed {args.repeats}x", flush=True)
    rows, t0 = [], time.time()
    for k in range(args.rounds):
        got = {}
        for label, v in (("A", a), ("B", b)):
            got[label] = bench_from(bench.evaluate(v, SLOW))
            r = got[label]
            print(f"round {k + 1} {label}: capacity {r.capacity:.3f} req/s (bracket {r.capacity_spread:.3f}), "
                  f"{r.output_tok_s:.1f} tok/s, attainment at the slice's rate {r.attainment:.2f}, probes "
                  f"{[[round(x, 3), round(y, 2)] for x, y in r.rate_probes]}", flush=True)
        ratio, low, high = capacity_ratio(got["B"], got["A"])
        rows.append({"round": k + 1, "A": got["A"].to_json(), "B": got["B"].to_json(), "ratio": ratio, "low": low,
                     "high": high})
    print("\n| round | A capacity (bracket) | B capacity (bracket) | B / A | range |\n|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['round']} | {row['A']['capacity']:.3f} ({row['A']['capacity_spread']:.3f}) | "
              f"{row['B']['capacity']:.3f} ({row['B']['capacity_spread']:.3f}) | {row['ratio']:.2f}x | "
              f"{row['low']:.2f}-{row['high']:.2f}x{' (holds 1: no gain)' if range_holds_one(row['low'], row['high']) else ''} |")
    caps = {s: [row[s]["capacity"] for row in rows] for s in ("A", "B")}
    if all(caps["A"]):
        print(f"median B / A over {len(rows)} rounds: {statistics.median(caps['B']) / statistics.median(caps['A']):.2f}x;"
              f" A's capacities {caps['A']}, B's {caps['B']}; {time.time() - t0:.0f} s")
    if args.out:
        args.out.write_text(json.dumps({"slo": [cfg.slo_ttft_s, cfg.slo_tpot_s], "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
