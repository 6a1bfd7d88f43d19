"""How far a host's step speed drifts between replays, and what that does to the simulator's capacity.

The judge's simulator is calibrated on the slow tier's steps and predicts capacity from them; its error against
the probes is printed each run. This benchmark separates the two sources of that error on one machine: it
calibrates on a slow-tier replay of the slice (as the main job does), then replays the same probe window at the
same rate ``--repeats`` times, spaced ``--gap`` seconds apart, and prints per replay the measured attainment,
its steps' time over the calibration's prediction (``step_drift``) and the simulated attainment of the same
window, with the calibration as fitted and scaled by that replay's drift. Last, the simulated capacity over the
search part with every step 0.9-1.5x the calibrated time: near the attainment curve's knee a small change in
step time moves the capacity several times as much.

    .venv/bin/python -m bench tuning.step_drift [--model smollm2] [--window 32] [--rate 3.2] [--repeats 4]
"""
from __future__ import annotations

import argparse
import time

from bench.lib import cli


def add_cli_args(ap: argparse.ArgumentParser) -> None:
    cli.add_model_args(ap, trace=True)
    ap.add_argument("--requests", type=int, default=16, help="the slice the slow tier replays (the calibration)")
    ap.add_argument("--max-input", type=int, default=64)
    ap.add_argument("--max-output", type=int, default=8)
    ap.add_argument("--num-kv-blocks", type=int, default=512)
    ap.add_argument("--window", type=int, default=32, help="the probe window's first request in the trace")
    ap.add_argument("--count", type=int, default=40, help="counted requests of the probe (after 4 warm-up)")
    ap.add_argument("--rate", type=float, default=3.2, help="the probe's rate (req/s)")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--gap", type=float, default=20.0, help="seconds between replays")


def main(args: argparse.Namespace) -> int:
    from engine import EngineConfig, LLMEngine, resolve
    from engine.config import static_best
    from engine.config.variant import VariantSpec
    from engine.loader.model_source import load_config
    from engine.loader.tokenizer import Tokenizer
    from ops.measure.hardware import probe
    from ops.measure.model_spec import model_spec
    from ops.measure.static_best_sweep import derive_slo, unloaded_points
    from ops.measure.tiers import _replay, own_rate, slow_tier
    from ops.predict.cost_model import predicted_capacity, scaled, simulate
    from ops.search.judge_search import step_drift
    from ops.search.worker import calibration_from
    from ops.traffic.corpus import corpus_for
    from ops.traffic.replay import synthesize_prompts
    from ops.traffic.traces import Windows, load_trace

    source = resolve(args.model)
    v = static_best.lookup(source, args.device, args.dtype) or VariantSpec(name="default")
    eng = LLMEngine(EngineConfig(source=source, device=args.device, dtype=args.dtype, variant=v,
                                 num_kv_blocks=args.num_kv_blocks, load_tokenizer=False))
    tok = Tokenizer(source.tokenizer_path) if source.tokenizer_path and source.kind != "synthetic" else None
    vocab = load_config(source).vocab_size
    stream = load_trace(args.trace)

    def prompts(recs, seed):
        return synthesize_prompts(recs, vocab, max_input=args.max_input, tokenizer=tok, seed=seed,
                                  corpus=corpus_for(args.trace) if tok else None)
    spec, hw = model_spec(source, args.dtype, None), probe(args.device)
    sl = stream[:args.requests]
    slo = derive_slo(unloaded_points(eng, prompts(sl, 0), args.max_output))
    res = slow_tier(eng, sl, prompts(sl, 0), "slice", repeats=1, max_output=args.max_output, slo=slo,
                    saturation_of=True)
    calibration = res.step_samples + res.saturation_samples
    cal = calibration_from(spec, hw, calibration, v)
    if cal is None:
        raise SystemExit("too few steps to calibrate on")
    sim = {"max_input": args.max_input, "max_output": args.max_output, "num_kv_blocks": args.num_kv_blocks,
           "slo_ttft_s": slo.ttft_s, "slo_tpot_s": slo.tpot_s, "slo_ttft_per_token_s": slo.ttft_per_token_s}
    print(f"{source.path.name} on {hw.device}, {v.name}; SLO {slo.describe()}; calibrated on {len(calibration)} "
          f"steps (fit error {cal.fit_mape:.0%})")
    recs = stream[args.window:args.window + args.count + 4]
    scale = own_rate(recs) / args.rate
    print(f"probe: requests #{args.window}-{args.window + len(recs) - 1} at {args.rate:.3f} req/s, 4 warm-up")
    print(f"{'replay':>6} {'measured':>9} {'step drift':>10} {'simulated':>9} {'sim. x drift':>12}")
    for k in range(args.repeats):
        if k:
            time.sleep(args.gap)
        eng.block_manager.reset_prefix_cache()
        r = _replay(eng, recs, prompts(recs, args.window), args.max_output, scale, slo, counted_from=4)
        got = sum(1 for s in r["status"][4:] if s) / args.count
        drift = step_drift(spec, hw, calibration, r["samples"], v=v) or 1.0
        at = [simulate(spec, hw, recs, v, c, time_scale=scale, counted=(4, 4 + args.count), **sim).attainment
              for c in (cal, scaled(cal, drift))]
        print(f"{k + 1:>6} {got:>9.2f} {drift:>9.2f}x {at[0]:>9.2f} {at[1]:>12.2f}")
    lo, hi = Windows(stream).bounds("search")
    search = stream[lo:min(hi, lo + 1000)]
    base = predicted_capacity(spec, hw, search, v, cal, **sim)
    print(f"simulated capacity over {len(search)} requests of the search part: {base:.3f} req/s; with every step")
    for f in (0.9, 1.1, 1.2, 1.3, 1.5):
        c = predicted_capacity(spec, hw, search, v, scaled(cal, f), **sim)
        print(f"  {f:.1f}x the calibrated time: {c:.3f} req/s ({c / base - 1:+.0%})" if base > 0 else f"  {f}: {c}")
    return 0


if __name__ == "__main__":
    raise SystemExit(cli.run(__doc__, add_cli_args, main))
