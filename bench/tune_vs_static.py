"""Tuning against static-best, measured as capacity at the SLO, on a CPU or a GPU.

For each traffic slice (the Azure conversation and the Mooncake traces): a search (``ops.tune.tune``) whose
baseline is the model's recorded static-best (``polyinf static-best``), the gates on its choice, the headline
``capacity at SLO, chosen / static-best`` and the gain split by dimension (each dimension of the choice applied
alone to static-best, measured on the slow tier in the same search). Then drift: the Azure slice with prompts
1.8x longer, and the Mooncake slice, each re-tuned, against the variant tuned on the Azure slice (stale),
both measured in the same search. Figures print as one table; JSON lands in --out.

    .venv/bin/python bench/tune_vs_static.py --out /tmp/tvs                       # SmolLM2 on the CPU
    PYTHONPATH=$PWD python3 bench/tune_vs_static.py --model llama-3.1-8b --device cuda --dtype bfloat16 \\
        --traces bench/data --requests 48 --max-input 2048 --max-output 128 --out $OUT   # a GPU host
    ... --layout-devices 2 --only azure mooncake          # with tensor-parallel and data-parallel layouts
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

from engine.variant import FORWARD, KV_LAYOUT, PARALLEL, SCHEDULER, SPECULATION_FIELDS, VariantSpec  # noqa: E402
from ops.optimize import capacity_line, capacity_ratio, range_holds_one  # noqa: E402
from ops.traces import load_trace  # noqa: E402
from ops.tune import Budget, Search, static_best_of, tune  # noqa: E402
from ops.worker import SLOW, SearchConfig, bench_from  # noqa: E402

ROWS: list[tuple[str, str]] = []
# a dimension: the VariantSpec fields of these scopes (speculation's fields apart from the other scheduler knobs,
# precision's apart from the other forward and KV-layout fields)
DIMENSIONS = {"scheduling knobs": (SCHEDULER, KV_LAYOUT), "kernels and graphs": (FORWARD,),
              "speculation": ("speculation",), "precision": ("precision",), "parallel layout": (PARALLEL,)}
PRECISION_FIELDS = ("weight_dtype", "kv_cache_dtype")


def dimension_of(f: dataclasses.Field) -> str | None:
    if f.name in SPECULATION_FIELDS:
        return "speculation"
    return "precision" if f.name in PRECISION_FIELDS else f.metadata.get("scope")


def row(out: Path, name: str, value: str) -> None:
    ROWS.append((name, value))
    print(f"{name:60} {value}", flush=True)
    with open(out / "rows.jsonl", "a") as f:
        f.write(json.dumps({"name": name, "value": value}) + "\n")


def only(base: VariantSpec, chosen: VariantSpec, scopes: tuple[str, ...]) -> VariantSpec:
    """``base`` with ``chosen``'s fields of the given scopes."""
    fields = {f.name: getattr(chosen, f.name) for f in dataclasses.fields(VariantSpec) if dimension_of(f) in scopes}
    return dataclasses.replace(base, name=f"static-best + {'/'.join(scopes)} of the choice", **fields)


def measure(cfg: SearchConfig, board: Path, search: str, variants: list[VariantSpec], who: str) -> dict:
    """Slow-tier results (capacity included) of ``variants`` in the given search, by variant id."""
    s = Search.start(cfg, board, search)
    for v in variants:
        s.board.enqueue(s.id, v, SLOW, who, v.name)
    s.measure(SLOW)
    return {v.variant_id: bench_from(r.bench) for r, v in s.results(SLOW)}


def ratio_row(out: Path, label: str, new, old) -> None:
    r, low, high = capacity_ratio(new, old)
    row(out, label, f"{r:.2f}x (range {low:.2f}-{high:.2f}x; {new.capacity:.3f} vs {old.capacity:.3f} req/s, brackets "
                    f"{new.capacity_spread:.3f}, {old.capacity_spread:.3f})"
                    f"{' = none: the range holds 1' if range_holds_one(low, high) else ''}")


def grown(trace: Path, out: Path, factor: float, requests: int) -> Path:
    """The trace's first requests with prompts ``factor`` times longer, as a capture file."""
    path = out / f"grown_{trace.stem}.jsonl"
    with open(path, "w") as f:
        for r in load_trace(trace)[:requests]:
            g = dataclasses.replace(r, input_tokens=max(1, round(r.input_tokens * factor)), source="grown")
            f.write(json.dumps(g.to_json()) + "\n")
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/tune_vs_static"))
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--traces", type=Path, default=ROOT / "traces",
                    help="folder with AzureLLMInferenceTrace_conv.csv and mooncake_conversation_trace.jsonl (or the "
                         "bench/data slices)")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--max-input", type=int, default=256)
    ap.add_argument("--max-output", type=int, default=32)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--fast-layers", type=int, default=4)
    ap.add_argument("--slow-repeats", type=int, default=2)
    ap.add_argument("--budget", type=int, default=9, help="experiments per search")
    ap.add_argument("--budget-seconds", type=float, default=900)
    ap.add_argument("--num-kv-blocks", type=int, default=1024)
    ap.add_argument("--slow-top", type=int, default=2, help="the fast tier's best measured on the slow tier")
    ap.add_argument("--layout-devices", type=int, default=1,
                    help="above 1: parallel layouts join the search, every slow-tier variant measured as served")
    ap.add_argument("--only", nargs="*", default=["azure", "mooncake", "drift"])
    ap.add_argument("--no-gate", action="store_true", help="skip the gates on each choice (to save device time)")
    ap.add_argument("--speculation", action=argparse.BooleanOptionalAction, default=True,
                    help="static-best with prompt-lookup speculation on the slow tier (the search's default: on)")
    ap.add_argument("--precision", action=argparse.BooleanOptionalAction, default=True,
                    help="static-best with quantized weights on the slow tier (the search's default: on)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    board = args.out / "board.sqlite"
    t0 = time.time()
    azure = next(iter(sorted(args.traces.glob("*zure*conv*"))))
    mooncake = next(iter(sorted(args.traces.glob("*ooncake*"))))

    def cfg(trace: Path) -> SearchConfig:
        return SearchConfig(model=args.model, trace=str(trace), device=args.device, dtype=args.dtype,
                            requests=args.requests, max_input=args.max_input, max_output=args.max_output,
                            time_scale=args.time_scale, fast_layers=args.fast_layers, fast_repeats=3,
                            slow_repeats=args.slow_repeats, num_kv_blocks=args.num_kv_blocks,
                            layout_devices=args.layout_devices)

    budget = Budget(args.budget, args.budget_seconds)
    static = static_best_of(cfg(azure))
    row(args.out, "static-best", f"{static.name} ({static.variant_id}): max_num_seqs {static.max_num_seqs}, budget "
                                 f"{static.max_num_batched_tokens}, chunk {static.prefill_chunk_size}, kernels "
                                 f"{dict(static.kernels) or 'reference'}")
    reports = {}
    for name, trace in (("azure", azure), ("mooncake", mooncake)):
        if name not in args.only:
            continue
        try:
            rep = reports[name] = tune(cfg(trace), board, budget=budget, slow_top=args.slow_top, gate=not args.no_gate,
                                       log=lambda m, n=name: print(f"[{n}] {m}", flush=True),
                                       speculation=args.speculation, precision=args.precision)
            (args.out / f"tune_{name}.json").write_text(json.dumps(rep.to_json(), indent=2, default=str))
            print(rep.text(), flush=True)
            base, chosen = rep.decision.get("baseline"), rep.decision.get("chosen")
            row(args.out, f"{name}: SLO", f"TTFT {1e3 * rep.config['slo_ttft_s']:.0f} ms, TPOT "
                                          f"{1e3 * rep.config['slo_tpot_s']:.0f} ms ({rep.config['slo_source']})")
            row(args.out, f"{name}: chosen", f"{rep.chosen['name']} ({rep.chosen['variant_id']}); {rep.decision['reason']}")
            row(args.out, f"{name}: gates", (rep.quality["verdict"] if rep.quality else "not run: static-best kept"
                                            if rep.chosen["variant_id"] == static.variant_id else "not run (--no-gate)"))
            if base and chosen:
                row(args.out, f"{name}: " + capacity_line(bench_from(chosen), bench_from(base)).split(":", 1)[0],
                    capacity_line(bench_from(chosen), bench_from(base)).split(": ", 1)[1])
                choice = VariantSpec.from_json(rep.chosen)
                if choice.variant_id != static.variant_id:
                    parts = {d: only(static, choice, scopes) for d, scopes in DIMENSIONS.items()}
                    parts = {d: v for d, v in parts.items() if v.variant_id != static.variant_id}
                    got = measure(cfg(trace), board, rep.search, list(parts.values()), "gain by dimension")
                    for d, v in parts.items():
                        ratio_row(args.out, f"{name}: gain by dimension, {d} alone", got[v.variant_id],
                                  bench_from(base))
            row(args.out, f"{name}: experiments, search seconds", f"{len(rep.rows)}, {rep.wall_s:.0f}")
        except Exception as e:  # one failed search must not lose the others
            row(args.out, f"{name}: FAILED", f"{type(e).__name__}: {e}")
            traceback.print_exc()
    if "drift" in args.only and "azure" in reports:
        stale = VariantSpec.from_json(reports["azure"].chosen)
        for label, trace in (("azure, prompts x1.8", grown(azure, args.out, 1.8, args.requests)),
                             ("switch to the mooncake shape", mooncake)):
            try:
                rep = reports.get("mooncake") if trace == mooncake else None
                rep = rep or tune(cfg(trace), board, budget=budget, slow_top=args.slow_top, gate=not args.no_gate,
                                  log=lambda m: print(f"[{label}] {m}", flush=True), speculation=args.speculation,
                                  precision=args.precision)
                retuned = VariantSpec.from_json(rep.chosen)
                got = measure(cfg(trace), board, rep.search, [dataclasses.replace(stale, name="stale")], "stale")
                ratio_row(args.out, f"drift, {label}: re-tuned / stale capacity", got[retuned.variant_id],
                          got[stale.variant_id])
            except Exception as e:
                row(args.out, f"drift, {label}: FAILED", f"{type(e).__name__}: {e}")
                traceback.print_exc()
    row(args.out, "total seconds", f"{time.time() - t0:.0f}")
    print("\n| what | figure |\n|---|---|\n" + "\n".join(f"| {n} | {v} |" for n, v in ROWS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
