"""Tuning against static-best, decided by the judge, on a CPU or a GPU.

For each traffic slice (the Azure conversation trace, the Mooncake conversation trace, and a bursty
long-prompt slice shaped like the Azure code trace): a search (``ops.search.tune.tune``) whose baseline is the
model's static-best, then the judge (``ops/judge/rule.py``, measured in lockstep by ``ops/judge/paired.py``): each arm's
capacity at the SLO with its 95% interval, every rate probe (at least ``--first-look`` counted requests), the
capacity ratio with its interval, the verdict (better, worse, no detectable difference, censored), the
out-of-sample confirmation and the simulator's error. Figures print as one table; JSON lands in --out.

The bursty slice is built here from the Azure 2023 code trace's published shape (Splitwise, Patel et al.
2024: coding prompts with a median of about 1,500 tokens, outputs of about 13; arrivals far burstier than
Poisson): gamma inter-arrival times of coefficient of variation ``--bursty-cv``, log-normal prompt and output
lengths, written as an Azure-format CSV (``bursty_code.csv`` in --out).

    .venv/bin/python -m bench tuning.tune_vs_static --out /tmp/tvs --slices azure          # SmolLM2 on the CPU
    PYTHONPATH=$PWD python3 -m bench tuning.tune_vs_static --model llama-3.1-8b --device cuda --dtype bfloat16 \\
        --traces bench/data --requests 64 --max-input 2048 --max-output 128 --first-look 300 --cap 600 \\
        --slices azure --out $OUT                                                  # a GPU host
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
import traceback
from datetime import datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from bench.lib.table import Table
from ops.judge.rule import Judgement  # noqa: E402
from ops.judge.paired import JudgeConfig  # noqa: E402
from ops.search.tune import Budget, static_best_of, tune  # noqa: E402
from ops.search.config import SearchConfig  # noqa: E402
from bench.lib import cli  # noqa: E402
from bench.lib.tiles import tiles_kept  # noqa: E402

TABLE = Table()


def bursty_code(path: Path, n: int, rate: float, cv: float, seed: int = 0) -> Path:
    """An Azure-format CSV of ``n`` requests: gamma inter-arrivals of mean 1/``rate`` s and coefficient of
    variation ``cv`` (shape 1/cv^2), log-normal prompts (median 1,500 tokens) and outputs (median 13)."""
    rng = random.Random(seed)
    shape = 1.0 / (cv * cv)
    t = datetime(2023, 11, 16, 18, 0, 0)
    with open(path, "w") as f:
        f.write("TIMESTAMP,ContextTokens,GeneratedTokens\n")
        for _ in range(n):
            t += timedelta(seconds=rng.gammavariate(shape, 1.0 / (shape * rate)))
            prompt = min(8000, max(32, round(rng.lognormvariate(math.log(1500), 0.7))))
            out = min(512, max(1, round(rng.lognormvariate(math.log(13), 0.9))))
            f.write(f"{t.strftime('%Y-%m-%d %H:%M:%S.%f')}0,{prompt},{out}\n")
    return path


def add_cli_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", type=Path, default=Path("/tmp/tune_vs_static"))
    cli.add_model_args(ap)
    ap.add_argument("--traces", type=Path, default=ROOT.parent / "shared" / "traces",
                    help="folder with AzureLLMInferenceTrace_conv.csv and mooncake_conversation_trace.jsonl")
    ap.add_argument("--slices", nargs="*", default=["azure", "mooncake", "bursty"],
                    help="azure, mooncake, bursty (the long-prompt slice built here)")
    ap.add_argument("--requests", type=int, default=24, help="the slow tier's slice; the judge's windows follow it")
    ap.add_argument("--max-input", type=int, default=64)
    ap.add_argument("--max-output", type=int, default=8)
    ap.add_argument("--fast-layers", type=int, default=4)
    ap.add_argument("--budget", type=int, default=6, help="experiments per search")
    ap.add_argument("--budget-seconds", type=float, default=600,
                    help="each search's wall time, its judge included (the judge gets what the stages before it "
                         "leave, at least 60 s, at most --judge-seconds)")
    ap.add_argument("--num-kv-blocks", type=int, default=1024)
    ap.add_argument("--slow-top", type=int, default=1, help="the fast tier's best measured on the slow tier")
    ap.add_argument("--first-look", type=int, help="counted requests at a probe's first look (the judge's default: "
                                                        "40 on a GPU, 20 on a CPU)")
    ap.add_argument("--cap", type=int, help="most counted requests of one probe")
    ap.add_argument("--judge-seconds", type=float, help="the judge's budget")
    ap.add_argument("--judge-top", type=int, help="candidates the judge compares with static-best")
    ap.add_argument("--bursty-requests", type=int, default=8000,
                    help="the bursty slice's length (at 4,000 a GPU judge's search part was replayed twice)")
    ap.add_argument("--bursty-rate", type=float, default=2.0, help="the bursty slice's mean rate (req/s)")
    ap.add_argument("--bursty-cv", type=float, default=3.0, help="its inter-arrival coefficient of variation")
    ap.add_argument("--gate", action="store_true", help="run the gates on each choice (costs device time)")
    ap.add_argument("--speculation", action=argparse.BooleanOptionalAction, default=False,
                    help="static-best with prompt-lookup speculation on the slow tier")
    ap.add_argument("--precision", action=argparse.BooleanOptionalAction, default=True,
                    help="static-best with quantized weights on the slow tier")


def main(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    with tiles_kept(args.out):  # the tiles autotuned on a GPU, kept as OUT/tile-table.json
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    TABLE.jsonl = args.out / "rows.jsonl"
    board = args.out / "board.sqlite"
    t0 = time.time()
    traces = {"azure": next(iter(sorted(args.traces.glob("*zure*conv*"))), None),
              "mooncake": next(iter(sorted(args.traces.glob("*ooncake*"))), None)}
    if "bursty" in args.slices:
        traces["bursty"] = bursty_code(args.out / "bursty_code.csv", args.bursty_requests, args.bursty_rate,
                                       args.bursty_cv)
    base_j = JudgeConfig.for_cpu() if args.device == "cpu" else JudgeConfig()
    jcfg = JudgeConfig(**{**base_j.to_json(), **{k: v for k, v in (
        ("first_look", args.first_look), ("cap", args.cap), ("seconds", args.judge_seconds),
        ("top", args.judge_top)) if v is not None}})
    if jcfg.cap < jcfg.first_look:
        jcfg = JudgeConfig(**{**jcfg.to_json(), "cap": jcfg.first_look})

    def cfg(trace: Path) -> SearchConfig:
        return SearchConfig(model=args.model, trace=str(trace), device=args.device, dtype=args.dtype,
                            requests=args.requests, max_input=args.max_input, max_output=args.max_output,
                            time_scale=1.0, fast_layers=args.fast_layers, fast_repeats=3, slow_repeats=1,
                            num_kv_blocks=args.num_kv_blocks)

    budget = Budget(args.budget, args.budget_seconds)
    for name in args.slices:
        trace = traces.get(name)
        if trace is None:
            TABLE.row(f"{name}: FAILED", f"no trace for {name} under {args.traces}")
            continue
        try:
            t = time.time()
            rep = tune(cfg(trace), board, budget=budget, slow_top=args.slow_top, gate=args.gate,
                       log=lambda m, n=name: print(f"[{n}] {m}", flush=True), speculation=args.speculation,
                       precision=args.precision, jcfg=jcfg)
            (args.out / f"tune_{name}.json").write_text(json.dumps(rep.to_json(), indent=2, default=str))
            print(rep.text(), flush=True)
            static = static_best_of(cfg(trace))
            TABLE.row(f"{name}: static-best", f"{static.name} ({static.variant_id})")
            TABLE.row(f"{name}: SLO", f"TTFT {1e3 * rep.config['slo_ttft_s']:.0f} ms + "
                                          f"{1e3 * rep.config.get('slo_ttft_per_token_s', 0.0):.3f} ms per prompt "
                                          f"token, TPOT {1e3 * rep.config['slo_tpot_s']:.1f} ms "
                                          f"({rep.config['slo_source']})")
            j = Judgement.from_json(rep.decision["judgement"]) if rep.decision.get("judgement") else None
            if j is None:
                TABLE.row(f"{name}: judge", "not run: " + rep.decision.get("reason", ""))
                continue
            for line in j.lines():
                print(line, flush=True)
            probes = [p for a in j.arms.values() if a.get("capacity") for p in a["capacity"]["probes"]]
            counted = [len(p["outcomes"]) for p in probes if p.get("outcomes")]
            TABLE.row(f"{name}: verdict", f"{j.verdict}; chosen {rep.chosen['name']}")
            TABLE.row(f"{name}: capacity ratio", j.headline())
            TABLE.row(f"{name}: probes", f"{len(probes)} probes, counted requests per probe min "
                                             f"{min(counted, default=0)}, median "
                                             f"{statistics.median(counted) if counted else 0:.0f}")
            if j.confirmation:
                TABLE.row(f"{name}: out of sample", j.confirmation.line())
            if not math.isnan(j.simulator_error):
                TABLE.row(f"{name}: simulator's capacity error", f"{j.simulator_error:.0%}")
            TABLE.row(f"{name}: experiments, seconds", f"{len(rep.rows)}, {time.time() - t:.0f} "
                                                           f"(judge {j.seconds:.0f})")
        except Exception as e:  # one failed search must not lose the others
            TABLE.row(f"{name}: FAILED", f"{type(e).__name__}: {e}")
            traceback.print_exc()
    TABLE.row("total seconds", f"{time.time() - t0:.0f}")
    print("\n" + TABLE.markdown())
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(__doc__, add_cli_args, main))
