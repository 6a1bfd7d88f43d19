"""The main job's decision re-measured by an independent client on traffic the job never saw.

Reads the newest engine build the job wrote (``--artifacts``; or ``--build``): its judgement names static-best
and the variant it chose, or, when it kept static-best, the candidate that came closest. Starts a real
``polyinf serve`` on loopback, and in ``--rounds`` interleaved rounds (A B, A B, ...) hot-swaps each arm in and
replays over HTTP (``ops/traffic/replay.py``, the OpenAI streaming client) ``--requests`` requests from the middle of
the trace's held-out part (its last third: the job's confirmation takes the start of it and its live
verification the end; nothing in the middle is replayed by the job), their lengths kept and their arrivals
redrawn as a Poisson process at ``--rate`` (default: the traffic's observed rate, as the judgement
recorded it; served over HTTP on the same cores the capacity is well below the in-process replays' claims,
so those rates overload both arms). Each request meets the job's SLO or not; the table gives each arm's attainment with its
Wilson 95% interval and the difference with Newcombe's, and says whether the verdict holds:

- chosen ("better"): the choice's attainment is higher (Newcombe's lower bound above 0);
- kept ("no detectable difference", "worse", "censored"): the candidate is not significantly better.

    .venv/bin/python -m bench tuning.heldout                                     # after `bash scripts/main.sh`
    .venv/bin/python -m bench tuning.heldout --requests 60 --rounds 2 --rate 1.344
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

import httpx  # noqa: E402

from engine import resolve  # noqa: E402
from engine.loader.model_source import load_config  # noqa: E402
from engine.loader.tokenizer import Tokenizer  # noqa: E402
from ops.search.board import Board  # noqa: E402
from ops.measure.capacity import newcombe, wilson  # noqa: E402
from ops.release.deploy import ServerProcess, _live_window  # noqa: E402
from ops.judge.rule import Judgement  # noqa: E402
from ops.traffic.corpus import corpus_for  # noqa: E402
from ops.traffic.replay import synthesize_prompts  # noqa: E402
from ops.traffic.traces import Windows, load_trace  # noqa: E402
from ops.search.config import SearchConfig  # noqa: E402
from bench.lib import cli  # noqa: E402


def newest_build(artifacts: Path) -> Path:
    builds = sorted((artifacts / "builds").glob("*.json"), key=lambda p: p.stat().st_mtime)
    if not builds:
        raise SystemExit(f"no engine build under {artifacts}/builds: run the main job first (bash scripts/main.sh)")
    return builds[-1]


def poisson(records: list, rate: float, seed: int) -> list:
    rng, t, out = random.Random(seed), 0.0, []
    for r in records:
        t += rng.expovariate(rate)
        out.append(dataclasses.replace(r, arrival_s=t))
    return out


def add_cli_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--artifacts", type=Path, default=ROOT / ".polyinf" / "artifacts")
    ap.add_argument("--build", type=Path, help="an engine build JSON (default: the newest under --artifacts)")
    ap.add_argument("--requests", type=int, default=120, help="requests per arm and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rate", type=float, help="req/s (default: the traffic's observed rate)")
    ap.add_argument("--out", type=Path, help="JSON of the figures")


def main(args: argparse.Namespace) -> int:
    path = args.build or newest_build(args.artifacts)
    build = json.loads(path.read_text())
    j = Judgement.from_json(build["judgement"])
    prov = build["provenance"]
    board = Board(ROOT / prov["board"] if not Path(prov["board"]).is_absolute() else prov["board"])
    cfg = SearchConfig(**{k: v for k, v in board.search_config(prov["search"]).items()
                          if k in SearchConfig.__dataclass_fields__})
    variants = {v.variant_id: v for _, v in board.results(prov["search"], "slow")}
    other = j.chosen if not j.kept else max(j.comparisons, key=lambda c: c.low).variant_id if j.comparisons else None
    if other is None:
        raise SystemExit("the judgement compared no candidate: nothing to re-measure")
    arms = {"static-best": variants[j.baseline], "candidate": variants[other]}
    caps = [j.capacity(v.variant_id) for v in arms.values()]
    observed = next((a.get("observed_rate") for a in j.arms.values() if a.get("observed_rate")), None)
    # served over HTTP (a server and its client on the same cores) the capacity is lower than the in-process
    # replays the judge measured: the traffic's own rate, where the job claims the forms differ or not
    rate = args.rate or observed or math.sqrt(max(caps[0].estimate, 1e-3) * max(caps[1].estimate, 1e-3))
    # the middle of the held-out part: after the confirmation's windows, before the live verification's
    records = load_trace(ROOT / cfg.trace if not Path(cfg.trace).is_absolute() else cfg.trace)
    lo, hi = Windows(records).bounds("held")
    n = args.requests * args.rounds * 2
    start = max(lo, (lo + hi) // 2 - n // 2)
    print(f"build {path.name}: verdict {j.verdict}; static-best {caps[0].describe()}, {arms['candidate'].name} "
          f"{caps[1].describe()}; replaying {n} held-out requests (#{start}-#{start + n - 1} of {len(records)}) at "
          f"{rate:.3f} req/s, Poisson arrivals, {args.rounds} rounds", flush=True)
    held = records[start:start + n]
    src = resolve(cfg.model)
    tok = Tokenizer(src.tokenizer_path) if src.tokenizer_path and src.kind != "synthetic" else None
    prompts = synthesize_prompts(held, load_config(src).vocab_size, max_input=cfg.max_input, tokenizer=tok,
                                 seed=start, corpus=corpus_for(cfg.trace) if tok else None)
    slo = cfg.slo
    server = ServerProcess(["--model", cfg.model, "--device", cfg.device, "--dtype", cfg.dtype,
                            "--num-kv-blocks", str(cfg.num_kv_blocks)], "heldout")
    met = {k: [] for k in arms}
    lags = []
    try:
        auth = {"Authorization": f"Bearer {server.token}"}
        k = 0
        for rnd in range(args.rounds):
            for name, v in arms.items():
                chunk = held[k * args.requests:(k + 1) * args.requests]
                p = prompts[k * args.requests:(k + 1) * args.requests]
                k += 1
                r = httpx.post(server.url + "/admin/variant", headers=auth, json=v.to_json(), timeout=600)
                r.raise_for_status()
                t = time.time()
                got, lag, failed = _live_window(server.url, "heldout", poisson(chunk, rate, seed=start + k), p, rate,
                                                slo, cfg.max_output)
                met[name] += got
                lags.append(lag)
                print(f"  round {rnd + 1}, {name:11}: {sum(got)}/{len(got)} met the SLO, send lag {1e3 * lag:.0f} ms, "
                      f"{failed} failed, {time.time() - t:.0f} s", flush=True)
    finally:
        server.stop()
    a, b = met["static-best"], met["candidate"]
    diff, dlo, dhi = newcombe(sum(b), len(b), sum(a), len(a))
    if not j.kept:
        holds = dlo > 0
    else:
        holds = dlo <= 0
    rows = [("static-best", a), (arms["candidate"].name, b)]
    print(f"\n| arm | attainment at {rate:.3f} req/s (95%) | requests | claimed capacity |\n|---|---|---|---|")
    for (name, m), c in zip(rows, caps):
        lo_, hi_ = wilson(sum(m), len(m))
        print(f"| {name} | {sum(m) / len(m):.3f} ({lo_:.3f}-{hi_:.3f}) | {len(m)} | {c.describe()} |")
    print(f"\ncandidate - static-best: {diff:+.3f} (Newcombe 95% {dlo:+.3f} to {dhi:+.3f}); the job's verdict "
          f"{j.verdict} ({'chose the candidate' if not j.kept else 'kept static-best'}): "
          f"{'holds' if holds else 'does NOT hold'}; worst send lag {1e3 * max(lags):.0f} ms")
    if args.out:
        args.out.write_text(json.dumps({"build": path.name, "verdict": j.verdict, "kept": j.kept, "rate": rate,
                                        "static_best": a, "candidate": b, "diff": [diff, dlo, dhi], "holds": holds,
                                        "max_lag_s": max(lags)}, indent=2))
    return 0 if holds else 1


if __name__ == "__main__":
    sys.exit(cli.run(__doc__, add_cli_args, main))
