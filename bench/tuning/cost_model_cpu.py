"""The cost model against measurement: a spread of knob variants replayed on the slow tier.

Replays a slice of the Azure conversation trace through SmolLM2 (all layers) for each variant,
fits the cost model's correction factors to full-model forward passes of a spread of shapes
(the baseline variant), and prints
predicted against measured output tokens/s, the MAPE (calibrated and plain roofline) and the
Spearman rank correlation on throughput; with ``--capacity`` also each variant's capacity at the SLO
(measured by the slow tier's rate search, about four minutes a variant here) against the predicted one.

    .venv/bin/python -m bench tuning.cost_model_cpu [--trace FILE] [--requests 24] [--capacity]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from engine.config.variant import VariantSpec  # noqa: E402
from ops.search.board import Board  # noqa: E402
from ops.predict.cost_model import ROOFLINE, mape, predicted_capacity, simulate, spearman  # noqa: E402
from ops.search.tune import Search  # noqa: E402
from ops.measure.hardware import probe  # noqa: E402
from ops.search.config import SLOW, SearchConfig  # noqa: E402
from ops.search.worker import Workbench  # noqa: E402
from bench.lib import cli  # noqa: E402

BASE = VariantSpec(name="baseline (default)")
VARIANTS = [BASE] + [dataclasses.replace(BASE, name=n, **kw) for n, kw in [
    ("seqs 1", {"max_num_seqs": 1}),
    ("seqs 2", {"max_num_seqs": 2}),
    ("seqs 4", {"max_num_seqs": 4}),
    ("seqs 8", {"max_num_seqs": 8}),
    ("budget 64", {"max_num_batched_tokens": 64}),
    ("budget 256", {"max_num_batched_tokens": 256}),
    ("chunk 32", {"prefill_chunk_size": 32}),
]]


def add_cli_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--trace", default=str(ROOT / "traces/AzureLLMInferenceTrace_conv.csv"))
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--max-input", type=int, default=128)
    ap.add_argument("--max-output", type=int, default=16)
    ap.add_argument("--time-scale", type=float, default=0.05)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--capacity", action="store_true", help="also measure and predict the capacity at the SLO")
    ap.add_argument("--json", type=Path, help="also write the figures here")


def main(args: argparse.Namespace) -> int:
    cfg = SearchConfig(trace=args.trace, requests=args.requests, max_input=args.max_input,
                       max_output=args.max_output, time_scale=args.time_scale, slow_repeats=args.repeats,
                       capacity_probes=6 if args.capacity else 0)
    t0 = time.perf_counter()
    hw = probe("cpu", size_mb=64)
    bench = Workbench(cfg, hw)
    cfg = bench.with_slo(BASE)  # one SLO (derived from the baseline) for the measurements and the predictions
    board = Board(":memory:")
    spec = bench.spec_for(SLOW)
    measured = {}
    for v in VARIANTS:
        measured[v.variant_id] = bench.evaluate(v, SLOW)
        print(f"  measured {v.name:20} {measured[v.variant_id]['output_tok_s']:7.1f} tok/s", flush=True)
    cal = Search(cfg, board, "cost-model-bench", hw, bench, BASE, None).calibration()
    rows = []
    for v in VARIANTS:
        m = measured[v.variant_id]
        rows.append({"variant": v.name, "measured": m["output_tok_s"], "spread": m["spread"],
                     "calibrated": simulate(spec, hw, bench.records, v, cal, **cfg.sim).output_tok_s,
                     "roofline": simulate(spec, hw, bench.records, v, ROOFLINE, **cfg.sim).output_tok_s})
        if args.capacity:
            rows[-1].update(capacity=m["capacity"], capacity_spread=m["capacity_spread"],
                            predicted_capacity=predicted_capacity(spec, hw, bench.records, v, cal, **cfg.sim))
    meas = [r["measured"] for r in rows]
    summary = {
        "variants": len(rows), "mape_calibrated": mape([r["calibrated"] for r in rows], meas),
        "mape_roofline": mape([r["roofline"] for r in rows], meas),
        "spearman_calibrated": spearman([r["calibrated"] for r in rows], meas),
        "spearman_roofline": spearman([r["roofline"] for r in rows], meas),
        "calibration": cal.to_json(), "hardware": hw.device, "seconds": time.perf_counter() - t0,
    }
    print(f"\n{'variant':22}{'measured tok/s':>16}{'spread':>8}{'calibrated':>12}{'roofline':>10}")
    for r in rows:
        print(f"{r['variant']:22}{r['measured']:16.1f}{r['spread']:8.1f}{r['calibrated']:12.1f}{r['roofline']:10.1f}")
    if args.capacity:
        caps = [r["capacity"] for r in rows]
        summary.update(capacity_mape=mape([r["predicted_capacity"] for r in rows], caps),
                       capacity_spearman=spearman([r["predicted_capacity"] for r in rows], caps))
        print(f"\n{'variant':22}{'capacity req/s':>16}{'bracket':>8}{'predicted':>12}")
        for r in rows:
            print(f"{r['variant']:22}{r['capacity']:16.3f}{r['capacity_spread']:8.3f}{r['predicted_capacity']:12.3f}")
        print(f"capacity: MAPE {summary['capacity_mape']:.1%}, Spearman {summary['capacity_spearman']:.2f}")
    print(f"\nMAPE: calibrated {summary['mape_calibrated']:.1%}, roofline {summary['mape_roofline']:.1%}")
    print(f"Spearman on throughput: calibrated {summary['spearman_calibrated']:.2f}, "
          f"roofline {summary['spearman_roofline']:.2f} (target >= 0.7)")
    print(f"calibration (fitted to {cal.samples} forward-pass shapes, fit MAPE {cal.fit_mape:.1%}): mem {cal.mem:.2f}, "
          f"compute {cal.compute:.2f}, launch {cal.launch:.2f}, per sequence {1e3 * cal.per_seq_s:.2f} ms")
    print(f"[{summary['seconds']:.0f} s]")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, **summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(__doc__, add_cli_args, main))
