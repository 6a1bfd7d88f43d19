"""Load and faults at size: 10,000 requests at 64 concurrent clients on loopback, SIGKILL mid-load and a
restart, a hot swap and a rollback under load, and the board's processes killed mid-write.

    .venv/bin/python -m bench load_faults [--requests 10000 --concurrency 64 --json out.json]

The server serves a tiny synthetic Qwen3-MoE (tests/engine/tiny_moe) on CPU, so the figures measure the
server, the capture and the board rather than a model. Prints one table: per scenario, requests sent,
answered, failed, lost (answered but not captured, or experiments missing), duplicated.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import httpx  # noqa: E402

from ops.release.loadtest import board_faults, check_capture, closed_loop, kill_and_restart, start_server, swap_under_load  # noqa: E402
from bench.lib import cli  # noqa: E402

TINY = ROOT / "tests" / "engine" / "tiny_moe"
MODEL_ARGS = ["--model", str(TINY), "--synthetic", "--num-kv-blocks", "1024", "--max-num-seqs", "64"]


def add_cli_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--experiments", type=int, default=200, help="board experiments for the kill test")
    ap.add_argument("--kills", type=int, default=30, help="worker kills in the board test")
    ap.add_argument("--json", default=None)


def main(args: argparse.Namespace) -> int:
    n, c = args.requests, args.concurrency
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        server = start_server(MODEL_ARGS, tmp / "steady")
        try:
            r = closed_loop(server.url, "load", n, c)
        finally:
            server.stop()
        cap = check_capture(tmp / "steady", r.ids)
        rows.append({"scenario": f"steady: {n} requests, {c} clients", "sent": r.sent, "answered": r.ok,
                     "failed": r.failed, "lost": cap["missing"], "duplicated": cap["duplicated"] + r.duplicated_answers,
                     "seconds": round(r.seconds, 1), "note": f"{r.ok / r.seconds:.0f} req/s; errors {dict(r.errors)}"})

        k = kill_and_restart(MODEL_ARGS, tmp / "kill", n=n // 2, concurrency=c, kill_after=n // 10)
        b, a = k["before_kill"], k["after_restart"]
        rows.append({"scenario": "SIGKILL mid-load, restart", "sent": b.sent + a.sent, "answered": b.ok + a.ok,
                     "failed": b.failed + a.failed, "lost": k["missing"], "duplicated": k["duplicated"],
                     "seconds": round(b.seconds + a.seconds, 1),
                     "note": f"{b.failed} cut by the kill (in flight); {k['unanswered']} captured but unanswered; "
                             f"after restart {a.failed} failed"})

        server = start_server(MODEL_ARGS, tmp / "swap")
        try:
            auth = {"Authorization": f"Bearer {server.token}"}
            active = httpx.get(server.url + "/admin/variant", headers=auth).json()["active"]
            base = {key: v for key, v in active.items() if key != "variant_id"}
            s = swap_under_load(server, [{**base, "block_size": 8},
                                         {**base, "block_size": 8, "kernels": {"rms_norm": "triton"}}], n // 5, c)
        finally:
            server.stop()
        cap = check_capture(tmp / "swap", s["load"].ids)
        rows.append({"scenario": "hot swap + rollback under load", "sent": s["load"].sent, "answered": s["load"].ok,
                     "failed": s["load"].failed, "lost": cap["missing"], "duplicated": cap["duplicated"],
                     "seconds": round(s["load"].seconds, 1),
                     "note": f"errors {dict(s['load'].errors)}; " + "; ".join(f"{'rollback' if w.get('rollback') else w.get('scopes')}: HTTP {w['status']} "
                                       f"{w.get('seconds', 0):.2f} s" for w in s["swaps"])})

        bf = board_faults(tmp / "board.sqlite", args.experiments, args.kills)
        rows.append({"scenario": f"board: {bf['worker_kills']} worker + {bf['producer_kills']} producer SIGKILLs",
                     "sent": bf["expected"], "answered": bf["done"], "failed": bf["expected"] - bf["done"],
                     "lost": bf["lost"], "duplicated": bf["duplicated"] + bf["double_results"],
                     "seconds": round(bf["seconds"], 1),
                     "note": f"{bf['leases_expired']} leases expired and resumed; integrity {bf['integrity']}"})

    cols = ("scenario", "sent", "answered", "failed", "lost", "duplicated", "seconds", "note")
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for row in rows:
        print("| " + " | ".join(str(row[col]) for col in cols) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(__doc__, add_cli_args, main))
