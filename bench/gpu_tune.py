"""The tuner on a GPU: searches for a Llama-3.1-8B-shaped model (synthetic bf16 weights) tuned to the
Azure conversation and Mooncake traces, each against the engine's default static configuration
replaying the same trace slice; then the Azure slice with prompts 80% longer, the stale variant
against a re-tuned one. The quality and contamination gates run on every chosen variant first.

    PYTHONPATH=$PWD python3 bench/gpu_tune.py --out $OUT

Traces: bench/data/ (copied slices; the GPU host cannot see shared/). On a CPU, for a smoke run:
    .venv/bin/python bench/gpu_tune.py --model smollm2 --device cpu --dtype float32 --requests 6 ...
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ops.tune import Budget, Search, tune  # noqa: E402
from ops.traces import load_trace  # noqa: E402
from ops.worker import SLOW, SearchConfig, bench_from  # noqa: E402

ROWS: list[tuple[str, str]] = []


def row(out: Path, name: str, value: str) -> None:
    ROWS.append((name, value))
    print(f"{name:64} {value}", flush=True)
    with open(out / "gpu_tune_rows.jsonl", "a") as f:
        f.write(json.dumps({"name": name, "value": value}) + "\n")


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else ("inf" if a else "n/a")


def summarize(out: Path, label: str, report) -> None:
    d = report.decision
    base, chosen = d.get("baseline"), d.get("chosen")
    gate = report.quality["verdict"] if report.quality else ("not run: baseline kept" if
                                                             report.chosen["variant_id"] == report.baseline["variant_id"]
                                                             else "not run")
    row(out, f"{label}: gates on the chosen variant", gate)
    if not base or not chosen:
        row(out, f"{label}: decision", d["reason"])
        return
    row(out, f"{label}: chosen", f"{report.chosen['name']} ({report.chosen['variant_id']})")
    row(out, f"{label}: goodput chosen / default (req/s)",
        f"{chosen['goodput']:.2f} / {base['goodput']:.2f} = {ratio(chosen['goodput'], base['goodput'])} "
        f"(spreads {chosen['goodput_spread']:.2f}, {base['goodput_spread']:.2f})")
    row(out, f"{label}: output tok/s chosen / default",
        f"{chosen['output_tok_s']:.1f} / {base['output_tok_s']:.1f} = "
        f"{ratio(chosen['output_tok_s'], base['output_tok_s'])} (spreads {chosen['spread']:.1f}, {base['spread']:.1f})")
    row(out, f"{label}: TTFT p50 / TPOT p50 chosen vs default (ms)",
        f"{1e3 * chosen['ttft_p50']:.0f} / {1e3 * chosen['tpot_p50']:.1f} vs "
        f"{1e3 * base['ttft_p50']:.0f} / {1e3 * base['tpot_p50']:.1f}")
    cm = report.cost_model
    row(out, f"{label}: cost model MAPE / Spearman; fast-tier Spearman",
        f"{cm['mape_calibrated']:.1%} / {cm['spearman_cost_model']:.2f}; {cm['spearman_fast_tier']:.2f} "
        f"({cm['variants']} variants)")
    row(out, f"{label}: experiments, search time", f"{len(report.rows)}, {report.wall_s:.0f} s")


def grown(trace: Path, out: Path, factor: float, requests: int) -> Path:
    """The trace's first requests with prompts ``factor`` times longer, as a capture file."""
    path = out / f"grown_{trace.stem}.jsonl"
    with open(path, "w") as f:
        for r in load_trace(trace)[:requests]:
            g = dataclasses.replace(r, input_tokens=max(1, round(r.input_tokens * factor)), source="grown")
            f.write(json.dumps(g.to_json() if hasattr(g, "to_json") else dataclasses.asdict(g)) + "\n")
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp"))
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--azure", type=Path, default=ROOT / "bench/data/azure_conv_400.csv")
    ap.add_argument("--mooncake", type=Path, default=ROOT / "bench/data/mooncake_conv_400.jsonl")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-input", type=int, default=2048)
    ap.add_argument("--max-output", type=int, default=64)
    ap.add_argument("--time-scale", type=float, default=0.1)
    ap.add_argument("--fast-layers", type=int, default=2)
    ap.add_argument("--slow-layers", type=int, default=None)
    ap.add_argument("--budget", type=int, default=8, help="experiments per search")
    ap.add_argument("--budget-seconds", type=float, default=150)
    ap.add_argument("--num-kv-blocks", type=int, default=4096)
    ap.add_argument("--slo-ttft-ms", type=float, default=1000)
    ap.add_argument("--slo-tpot-ms", type=float, default=50)
    ap.add_argument("--only", nargs="*", default=["azure", "mooncake", "growth"])
    ap.add_argument("--stale", type=Path, default=None,
                    help="growth without the azure search: the stale variant from an earlier run's tune_azure.json")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    board = args.out / "board.sqlite"
    t0 = time.time()

    def cfg(trace: Path) -> SearchConfig:
        return SearchConfig(model=args.model, trace=str(trace), device=args.device, dtype=args.dtype,
                            requests=args.requests, max_input=args.max_input, max_output=args.max_output,
                            time_scale=args.time_scale, fast_layers=args.fast_layers, slow_layers=args.slow_layers,
                            fast_repeats=3, slow_repeats=3, num_kv_blocks=args.num_kv_blocks,
                            slo_ttft_s=args.slo_ttft_ms / 1e3, slo_tpot_s=args.slo_tpot_ms / 1e3)

    budget = Budget(args.budget, args.budget_seconds)
    reports = {}
    for name, trace in (("azure", args.azure), ("mooncake", args.mooncake)):
        if name not in args.only:
            continue
        try:
            reports[name] = tune(cfg(trace), board, budget=budget, slow_top=2, gate=True,
                                 log=lambda m, n=name: print(f"[{n}] {m}", flush=True))
            (args.out / f"tune_{name}.json").write_text(json.dumps(reports[name].to_json(), indent=2, default=str))
            print(reports[name].text(), flush=True)
            summarize(args.out, name, reports[name])
        except Exception as e:  # one failed search must not lose the others
            row(args.out, f"{name}: FAILED", f"{type(e).__name__}: {e}")
            traceback.print_exc()
    if "growth" in args.only and ("azure" in reports or args.stale):
        try:
            path = grown(args.azure, args.out, 1.8, args.requests)
            stale = reports["azure"].chosen if "azure" in reports else json.loads(args.stale.read_text())["chosen"]
            retuned = tune(cfg(path), board, budget=budget, slow_top=2, gate=True,
                           log=lambda m: print(f"[growth] {m}", flush=True))
            print(retuned.text(), flush=True)
            summarize(args.out, "azure +80% prompts, re-tuned vs default", retuned)
            # the stale variant (tuned on the original lengths) replayed on the grown slice in the same search
            s = Search.start(cfg(path), board, retuned.search)
            from engine.variant import VariantSpec

            stale_v = VariantSpec.from_json(stale)
            s.board.enqueue(s.search, stale_v, SLOW, "stale", "the variant tuned before prompts grew")
            s.measure(SLOW)
            by_id = {v.variant_id: bench_from(r.bench) for r, v in s.results(SLOW)}
            new = by_id[retuned.chosen["variant_id"]]
            old = by_id[stale_v.variant_id]
            row(args.out, "azure +80% prompts: re-tuned / stale goodput (req/s)",
                f"{new.goodput:.2f} / {old.goodput:.2f} = {ratio(new.goodput, old.goodput)} "
                f"(spreads {new.goodput_spread:.2f}, {old.goodput_spread:.2f})")
            row(args.out, "azure +80% prompts: re-tuned / stale output tok/s",
                f"{new.output_tok_s:.1f} / {old.output_tok_s:.1f} = {ratio(new.output_tok_s, old.output_tok_s)} "
                f"(spreads {new.spread:.1f}, {old.spread:.1f})")
        except Exception as e:
            row(args.out, "growth: FAILED", f"{type(e).__name__}: {e}")
            traceback.print_exc()
    row(args.out, "total seconds", f"{time.time() - t0:.0f}")
    print("\n" + "\n".join(f"| {n} | {v} |" for n, v in ROWS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
