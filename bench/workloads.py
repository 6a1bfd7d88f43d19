"""Non-LLM workloads (FNO, weather GNN, protein e3nn, PatchTST) through the loop: static-best, candidates, the gate,
both tiers, the choice; tuned / static-best throughput per model, bit-exact and tolerance-mode gains apart.

Each model is tuned by ops.workloads.tune.tune_workload on the request sizes of the Azure conversation trace
(ops/workloads/traffic.py maps its prompt lengths to the model's sizes). Runs on a CPU or, unchanged, on a CUDA host
with torch, torch_geometric and e3nn (``--device cuda``). A run cut short keeps what it finished: each model's rows
print (flushed) and ``--json`` is rewritten as soon as that model is done; ``--budget-seconds`` shares a time limit
among the models still to run; a model that raises is reported and the next one runs.
"""
from __future__ import annotations

import argparse
import json
import os
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
    ap.add_argument("--candidates", default=None, help="comma-separated candidate names to measure (default all; "
                    "ops.workloads.tune.CANDIDATE_NAMES), e.g. leave out autotune on a short GPU run")
    ap.add_argument("--budget-seconds", type=float, default=None, help="seconds for the whole run: each model may "
                    "take the time left over the models still to run (past 60%% of its share it measures no further "
                    "candidate, past all of it no paired round after the third); a model that would start with "
                    "no time left is not run")
    ap.add_argument("--allow-tolerance", action="store_true", help="a variant passing only tolerance mode may be chosen")
    ap.add_argument("--sweep", action="store_true", help="sweep static-best's batch even where a sweep is recorded "
                    "for this kind of device (engine/data/workload_static_best.json)")
    ap.add_argument("--record", action="store_true", help="record each sweep that runs in that file")
    ap.add_argument("--json", type=Path, default=None, help="write every tuning's figures here (after each model)")


def _gate(arm) -> str:
    if arm.error:
        return f"error ({arm.error})"
    g = arm.gate
    # the library's own batch variance at these batches (the reference batched against one request at a time)
    var = f"; batches vs one at a time {g.batch_max_abs:.2g}" if g.batch_max_abs else ""
    if g.passed:
        return (g.mode if g.mode == "bit-exact" else f"tolerance (max abs {g.max_abs:.2g}, rel {g.max_rel:.2g})") + var
    t = arm.tolerance_gate
    tol = f", tolerance {'passes' if t.passed else 'fails'} (rel {t.max_rel:.2g})" if t else ""
    return f"fails {g.mode} (max abs {g.max_abs:.2g}){tol}{var}"


def _arm_figure(arm) -> str:
    if arm.skipped:
        return f"not measured: {arm.skipped}"
    return f"{arm.fast:.1f} req/s fast tier; gate {_gate(arm)}; {arm.seconds:.1f} s"


def write_json(path: Path, entries: list[dict]) -> None:
    """Replaces ``path`` with ``entries`` whole (a temporary file renamed over it: a kill leaves the last copy)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(entries, indent=1))
    os.replace(tmp, path)


def report(table: Table, name: str, t) -> None:
    """One tuning's rows (ops.workloads.tune.WorkloadTuning), printed as they are added."""
    s, sw = t.static, t.sweep
    if sw is not None:
        swept = ", ".join(f"batch {b} {r:.1f}" for b, r in sw.throughput.items())
        failed = "; failed: " + "; ".join(f"{k}: {v}" for k, v in sw.errors.items()) if sw.errors else ""
        note = f"; {sw.note}" if sw.note else ""
        table.row(f"{name}: static-best sweep", f"{swept} req/s{failed}{note}; {sw.seconds:.1f} s")
    slow = f"; slow tier {t.static_slow.throughput:.1f} req/s, p50 {t.static_slow.p50 * 1e3:.1f} ms, p99 " \
           f"{t.static_slow.p99 * 1e3:.1f} ms" if t.static_slow else ""
    table.row(f"{name}: static-best ({s.variant.describe()})", f"{s.fast:.1f} req/s fast tier{slow}; "
              f"gate {_gate(s)}; {s.seconds:.1f} s")
    for arm in t.arms:
        table.row(f"{name}:   {arm.variant.name} ({arm.variant.describe()})", _arm_figure(arm))
    for label, comp in (("bit-exact", t.exact), ("tolerance-mode", t.tolerance)):
        if comp is None:
            measured = any(a.gate for a in t.arms)
            table.row(f"{name}: {label} gain", "no candidate passed" if measured else "no candidate measured")
        else:
            err = f" ({comp.error})" if comp.error else ""
            table.row(f"{name}: {label} gain ({comp.arm.variant.name})",
                      f"{comp.ratio.line()}: {comp.ratio.verdict}{err}; {comp.seconds:.1f} s")
    if t.unmeasured:
        table.row(f"{name}: not measured (time budget spent)", ", ".join(t.unmeasured))
    budget = f" of a {t.budget_s:.0f} s share" if t.budget_s else ""
    table.row(f"{name}: chosen", f"{t.chosen.name} ({t.chosen.describe()}), {t.verdict}; {t.seconds:.0f} s{budget}")


def _release(device: str) -> None:
    """Between models: the finished model's compiled code and cached memory go (no runner of it is left)."""
    import gc

    import torch._dynamo

    torch._dynamo.reset()
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def main(args: argparse.Namespace) -> int:
    from engine.workloads.variants import deterministic_cublas
    from ops.workloads.tune import TuneConfig, error_line, tune_workload

    deterministic_cublas()  # before the first CUDA matmul: the deterministic variants' GEMMs too

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here", file=sys.stderr)
        return 2
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    try:
        cfg = TuneConfig(compile_candidates=not args.no_compile, allow_tolerance=args.allow_tolerance,
                         recorded=not args.sweep, record=args.record,
                         candidates=tuple(c.strip() for c in (args.candidates or "").split(",") if c.strip()))
    except ValueError as e:
        print(f"--candidates: {e}", file=sys.stderr)
        return 2
    if args.device.startswith("cuda"):  # a GPU serves these sizes in milliseconds: more requests and rounds
        cfg = replace(cfg, requests=240, mix=32, repeats=5, rounds=6)
    cfg = replace(cfg, **{k: v for k, v in (("requests", args.requests), ("rounds", args.rounds)) if v})
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    device = f"{args.device} ({gpu}, {torch.get_num_threads()} threads), torch {torch.__version__}"
    print(f"device: {device}", flush=True)
    table, out = Table(width=58), []
    t0 = time.perf_counter()
    for i, name in enumerate(names):
        share = None
        if args.budget_seconds:
            left = args.budget_seconds - (time.perf_counter() - t0)
            if left <= 0:
                out.append({"workload": name, "skipped": "time budget spent"})
                table.row(f"{name}: not run", "time budget spent")
                continue
            share = left / (len(names) - i)
        print(f"{name}: tuning" + (f" (a {share:.0f} s share)" if share else "") + " ...", flush=True)
        m0 = time.perf_counter()
        try:
            t = tune_workload(name, args.device, replace(cfg, budget_s=share))
        except Exception as e:  # noqa: BLE001 -- one model's failure is its row; the next model still runs
            out.append({"workload": name, "error": error_line(e), "seconds": time.perf_counter() - m0})
            table.row(f"{name}: failed", f"{error_line(e)}; {time.perf_counter() - m0:.0f} s")
        else:
            out.append(t.to_json())
            report(table, name, t)
        if args.json:
            write_json(args.json, out)
        _release(args.device)
    table.row("device", f"{device}; {time.perf_counter() - t0:.0f} s")
    print()
    print(table.markdown(), flush=True)
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(__doc__, add_cli_args, main))
