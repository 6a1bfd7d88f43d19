"""Non-LLM workloads (FNO, weather GNN, protein e3nn, PatchTST) through the loop: static-best, candidates, the gate,
both tiers, the choice; tuned / static-best throughput per model, bit-exact and tolerance-mode gains apart.

Each model is tuned by ops.workloads.tune.tune_workload on the request sizes of the Azure conversation trace
(ops/workloads/traffic.py maps its prompt lengths to the model's sizes). Runs on a CPU or, unchanged, on a CUDA host
with torch, torch_geometric and e3nn (``--device cuda``). ``--json`` writes every figure.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench.lib import cli
from bench.lib.table import Table


def add_cli_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    ap.add_argument("--models", default="fno,weather_gnn,protein_e3nn,patchtst", help="comma-separated workloads")
    ap.add_argument("--requests", type=int, default=None, help="trace requests the slow tier replays")
    ap.add_argument("--rounds", type=int, default=None, help="paired slow-tier rounds per comparison")
    ap.add_argument("--no-compile", action="store_true", help="leave compiled candidates out (each new shape "
                    "compiles: minutes on a small CPU)")
    ap.add_argument("--allow-tolerance", action="store_true", help="a variant passing only tolerance mode may be chosen")
    ap.add_argument("--json", type=Path, default=None, help="write every tuning's figures here")


def _gate(arm) -> str:
    if arm.error:
        return f"error ({arm.error})"
    g = arm.gate
    if g.passed:
        return g.mode if g.mode == "bit-exact" else f"tolerance (rel {g.max_rel:.2g})"
    t = arm.tolerance_gate
    tol = f", tolerance {'passes' if t.passed else 'fails'} (rel {t.max_rel:.2g})" if t else ""
    return f"fails {g.mode} (max abs {g.max_abs:.2g}){tol}"


def main(args: argparse.Namespace) -> int:
    from ops.workloads.tune import TuneConfig, tune_workload

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here", file=sys.stderr)
        return 2
    cfg = TuneConfig(compile_candidates=not args.no_compile, allow_tolerance=args.allow_tolerance)
    if args.device.startswith("cuda"):  # a GPU serves these sizes in milliseconds: more requests and rounds
        cfg = replace(cfg, requests=240, mix=32, repeats=5, rounds=6)
    cfg = replace(cfg, **{k: v for k, v in (("requests", args.requests), ("rounds", args.rounds)) if v})
    table, out = Table(width=58), []
    t0 = time.perf_counter()
    for name in args.models.split(","):
        t = tune_workload(name.strip(), args.device, cfg)
        out.append(t.to_json())
        s = t.static
        slow = f"; slow tier {t.static_slow.throughput:.1f} req/s, p50 {t.static_slow.p50 * 1e3:.0f} ms, p99 " \
               f"{t.static_slow.p99 * 1e3:.0f} ms" if t.static_slow else ""
        table.row(f"{name}: static-best ({s.variant.describe()})", f"{s.fast:.1f} req/s fast tier{slow}; "
                  f"gate {_gate(s)}")
        for arm in t.arms:
            table.row(f"{name}:   {arm.variant.name} ({arm.variant.describe()})",
                      f"{arm.fast:.1f} req/s fast tier; gate {_gate(arm)}")
        for label, comp in (("bit-exact", t.exact), ("tolerance-mode", t.tolerance)):
            if comp is None:
                table.row(f"{name}: {label} gain", "no candidate passed")
            else:
                table.row(f"{name}: {label} gain ({comp.arm.variant.name})",
                          f"{comp.ratio.line()}: {comp.ratio.verdict}")
        table.row(f"{name}: chosen", f"{t.chosen.name} ({t.chosen.describe()}), {t.verdict}; {t.seconds:.0f} s")
    table.row("device", f"{args.device} ({torch.cuda.get_device_name() if args.device.startswith('cuda') else 'cpu'},"
              f" {torch.get_num_threads()} threads), torch {torch.__version__}; {time.perf_counter() - t0:.0f} s")
    print()
    print(table.markdown())
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(__doc__, add_cli_args, main))
