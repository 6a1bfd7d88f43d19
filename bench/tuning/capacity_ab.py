"""Capacity at the SLO of static-best against one change to it, judged as the loop judges a choice: both forms
measured on the slow tier, then replayed in lockstep on fresh windows of the trace by one engine that hot-swaps
between them (saturation in paired rounds, each one's capacity searched with sequential probes to a bracket
with its interval), the decision rule (ratio interval, latency guard) and, when the change wins, its
confirmation on held-out windows. A gain a search reported can so be checked apart from the search that found
it.

    .venv/bin/python -m bench tuning.capacity_ab --change '{"max_num_seqs": 4}'                 # SmolLM2 on the CPU
    PYTHONPATH=$PWD python3 -m bench tuning.capacity_ab --model llama-3.1-8b --device cuda --dtype bfloat16 \\
        --trace bench/data/mooncake_conversation_trace.jsonl --requests 64 --max-input 2048 --max-output 128 \\
        --num-kv-blocks 8192 --change '{"block_size": 32}'                                # a GPU host
    ... --quantize fp8                                   # static-best against its FP8 form, as the tuner proposes it
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from ops.measure.hardware import probe
from ops.judge.paired import ArmRun, JudgeConfig, PairedJudge, run_judgement
from ops.traffic.traces import Windows
from ops.search.config import SLOW, SearchConfig, static_best_of
from ops.search.worker import Workbench
from bench.lib import cli


def add_cli_args(ap: argparse.ArgumentParser) -> None:
    cli.add_model_args(ap, trace=True)
    ap.add_argument("--requests", type=int, default=16, help="requests of the slow tier's slice (the judge's "
                    "windows follow them in the trace)")
    ap.add_argument("--max-input", type=int, default=128)
    ap.add_argument("--max-output", type=int, default=16)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--num-kv-blocks", type=int, default=1024)
    ap.add_argument("--change", default="{}", help="JSON object of VariantSpec fields to change in static-best")
    ap.add_argument("--base-change", default="{}",
                    help="JSON object of VariantSpec fields that make A from static-best (B is built on A; the SLO "
                         "stays static-best's): to judge one dimension against a static form that has the rest")
    ap.add_argument("--quantize", choices=["fp8", "int8"],
                    help="B is static-best with these weights, as the tuner proposes it "
                         "(engine.config.presets.quantized_variant; on a GPU with prefill_graphed), before --change")
    ap.add_argument("--judge-seconds", type=float, help="the judge's budget (default: 140 on a CPU, 600 on a GPU)")
    ap.add_argument("--first-look", type=int, help="counted requests at a probe's first look")
    ap.add_argument("--cap", type=int, help="most counted requests of one probe")
    ap.add_argument("--slo-ttft-ms", type=float)
    ap.add_argument("--slo-tpot-ms", type=float)
    ap.add_argument("--out", type=Path, help="a JSON file for the judgement")


def _json_object(text: str, flag: str) -> dict:
    try:
        got = json.loads(text)
        if not isinstance(got, dict):
            raise ValueError(f"{flag} must be a JSON object")
    except ValueError as e:
        sys.exit(f"capacity_ab: {flag}: {e}")
    return got


def main(args: argparse.Namespace) -> int:
    change, base_change = _json_object(args.change, "--change"), _json_object(args.base_change, "--base-change")
    cfg = SearchConfig(model=args.model, trace=args.trace, device=args.device, dtype=args.dtype,
                       requests=args.requests, max_input=args.max_input, max_output=args.max_output,
                       time_scale=args.time_scale, num_kv_blocks=args.num_kv_blocks,
                       slo_ttft_s=args.slo_ttft_ms / 1e3 if args.slo_ttft_ms else None,
                       slo_tpot_s=args.slo_tpot_ms / 1e3 if args.slo_tpot_ms else None)
    best = static_best_of(cfg)
    try:
        a = dataclasses.replace(best, name=f"{best.name} + {args.base_change}", **base_change) if base_change else best
    except Exception as e:  # an unknown field (TypeError) or a value the spec refuses (ConfigError)
        sys.exit(f"capacity_ab: --base-change: {type(e).__name__}: {e}")
    if not change and not args.quantize:
        sys.exit("capacity_ab: nothing to compare: give --change, --quantize or both")
    try:
        from engine.config.presets import prefill_graphed, quantized_variant

        b = quantized_variant(a, args.quantize, cfg.device,
                              name=f"{a.name if base_change else 'static-best'} + {args.quantize} weights") \
            if args.quantize else a
        if args.quantize and cfg.device.startswith("cuda"):  # as ops/search/tune.py's precision candidate
            b = dataclasses.replace(prefill_graphed(b), name=f"{b.name}, prefill graphs")
        b = dataclasses.replace(b, name=" + ".join([b.name] + ([args.change] if change else [])), **change)
    except Exception as e:  # an unknown field (TypeError) or a value the spec refuses (ConfigError)
        sys.exit(f"capacity_ab: --change / --quantize: {type(e).__name__}: {e}")
    bench = Workbench(cfg, probe(cfg.device, size_mb=64 if cfg.device == "cpu" else 256))
    cfg = bench.with_slo(best)
    print(f"A: {a.name} ({a.variant_id}); B: {b.name} ({b.variant_id}): {b.changes_from(a)}")
    print(f"SLO: {cfg.slo.describe()} ({cfg.slo_source}); slow tier on {args.requests} requests of {args.trace}",
          flush=True)
    measured = {v.variant_id: bench.evaluate(v, SLOW) for v in (a, b)}
    kw = {k: v for k, v in (("seconds", args.judge_seconds), ("first_look", args.first_look), ("cap", args.cap))
          if v is not None}
    jcfg = JudgeConfig.for_cpu(**kw) if cfg.device == "cpu" else JudgeConfig(**kw)
    # the steps the prediction was calibrated on (as the main job's judge: the slow tier's and its saturation's)
    arms = [ArmRun(v, predicted=measured[v.variant_id].get("capacity_predicted", 0.0),
                   samples=list(measured[v.variant_id].get("step_samples", []))
                   + list(measured[v.variant_id].get("saturation_samples", []))) for v in (a, b)]
    calibrated_on = {arm.variant.variant_id: len(arm.samples) for arm in arms}
    latencies = {k: (d.get("ttfts", []), d.get("tpots", [])) for k, d in measured.items()}
    pj = PairedJudge(lambda v: bench.engine(SLOW, v), bench.prompts_for,
                     Windows(bench.stream, skip=len(bench.records)), cfg.slo, cfg.max_output, jcfg,
                     log=lambda m: print(m, flush=True))
    j, caps = run_judgement(pj, arms[0], arms[1:], latencies)
    simulator_on_probes(bench, cfg, j, arms, caps, calibrated_on, pj.windows.records)
    print()
    for line in j.lines():
        print(line)
    print(f"\nB / A: {j.headline()}")
    if args.out:
        samples = {arm.variant.variant_id: arm.samples for arm in arms}
        args.out.write_text(json.dumps({"slo": dataclasses.asdict(cfg.slo), "judgement": j.to_json(),
                                        "config": jcfg.to_json(), "step_samples": samples}, indent=1))
    return 0


def simulator_on_probes(bench: Workbench, cfg: SearchConfig, j, arms: list[ArmRun], caps: dict, calibrated_on: dict,
                        records: list) -> None:
    """Where the simulator's capacity error comes from, per arm, as the main job's judge reports it
    (``ops.search.judge_search.probe_diagnostics``): recorded on the judgement and printed."""
    from types import SimpleNamespace

    from ops.search.judge_search import drift_kinds, probe_diagnostics

    search = SimpleNamespace(model_spec=bench.spec_for(SLOW), hardware=bench.hardware, cfg=cfg)
    for arm in arms:
        vid = arm.variant.variant_id
        got, _ = probe_diagnostics(search, arm, calibrated_on[vid], caps[vid], records)
        j.arms[vid].update(got)
        parts = [f"the steps replayed after the calibration took {got['step_drift_on_probes']:.2f}x its "
                 "prediction" + drift_kinds(got)] if "step_drift_on_probes" in got else []
        if "capacity_on_probes" in got:
            censored = f" (censored {got['censored_on_probes']})" if got.get("censored_on_probes") else ""
            parts.append(f"capacity over the simulated probes {got['capacity_on_probes']:.3f} req/s{censored}, "
                         f"measured {caps[vid].estimate:.3f}; mean attainment error "
                         f"{got['attainment_error_on_probes']:.2f}")
            if "attainment_error_drift_corrected" in got:
                parts.append(f"{got['attainment_error_drift_corrected']:.2f} with each probe's steps at their measured "
                             "speed (" + ", ".join(f"{d:.2f}x" for d in got["drift_on_probes"]) + ")")
        if parts:
            print(f"simulator on {arm.variant.name}: " + "; ".join(parts), flush=True)


if __name__ == "__main__":
    sys.exit(cli.run(__doc__, add_cli_args, main))
