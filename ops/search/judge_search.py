"""The judge run on a search: the slow tier's variants ranked by the simulator, the best compared with
static-best in lockstep (ops/judge/paired.py) and decided by the rule (ops/judge/rule.py), with the simulator's
figures per arm. The bridge between the search and the judge, so the judge imports nothing of the search."""
from __future__ import annotations

import math
import statistics

from engine.config.variant import VariantSpec
from ops.judge import rule as judge
from ops.judge.paired import ArmRun, JudgeConfig, PairedJudge, run_judgement
from ops.measure.tiers import own_rate
from ops.search.config import SLOW
from ops.traffic.traces import Windows


def judge_search(search, jcfg: JudgeConfig | None = None, excluded: dict[str, str] | None = None) -> judge.Judgement:
    """The judge of a search (``search``: ops.search.tune.Search): the slow tier's variants ranked by the simulator
    (calibrated on each one's own replayed steps, over thousands of the trace's requests), the ``top`` best
    replayed in lockstep with static-best on fresh windows of the trace, each one's capacity with its interval,
    the decision (Holm, guards), the out-of-sample confirmation, and the simulator's figures beside the
    measured ones: goodput at 1x, 1.5x and 2x the traffic's rate and the capacity under gamma arrivals of the
    traffic's burstiness. Posted on the board; ``excluded``: variant id -> why it may not be chosen."""

    jcfg = jcfg or (JudgeConfig.for_cpu() if search.cfg.device == "cpu" else JudgeConfig())
    excluded = excluded or {}
    slow = search.results(SLOW)
    base = next(((r, v) for r, v in slow if v.variant_id == search.baseline.variant_id), None)
    if base is None:
        raise RuntimeError("no slow-tier measurement of static-best: nothing to judge against")
    notes = [f"{v.name} excluded: {excluded[v.variant_id]}" for _, v in slow if v.variant_id in excluded]
    layouts = [v for _, v in slow if v.tp * v.dp > 1]
    if layouts:
        notes.append("parallel layouts (" + ", ".join(v.name for v in layouts) + ") are measured served, "
                     "one restart each, and judged on their served replay only: not compared in lockstep")
    cands = [(r, v) for r, v in slow if v.variant_id != search.baseline.variant_id and v.variant_id not in excluded
             and v.tp * v.dp == 1]
    cands.sort(key=lambda rv: rv[0].bench.get("capacity_predicted", 0.0), reverse=True)
    picked = cands[:jcfg.top]
    if len(cands) > len(picked):
        notes.append("not compared (the simulator predicts less): " + ", ".join(
            f"{v.name} ({r.bench.get('capacity_predicted', 0.0):.3f} req/s predicted)" for r, v in cands[len(picked):]))
    arms = [ArmRun(v, predicted=r.bench.get("capacity_predicted", 0.0),
                   samples=list(r.bench.get("step_samples", [])) + list(r.bench.get("saturation_samples", [])))
            for r, v in [base] + picked]
    latencies = {v.variant_id: (r.bench.get("ttfts", []), r.bench.get("tpots", [])) for r, v in [base] + picked}
    windows = Windows(search.bench.stream, skip=len(search.bench.records))
    pj = PairedJudge(lambda v: search.bench.engine(SLOW, v), search.bench.prompts_for, windows, search.cfg.slo,
                     search.cfg.max_output, jcfg, log=search.log)
    search.log(f"judge: static-best against {', '.join(v.name for _, v in picked) or 'no candidate'} in lockstep, "
               f"budget {jcfg.seconds:.0f} s")
    calibrated_on = {a.variant.variant_id: len(a.samples) for a in arms}  # the slow tier's steps, before any probe
    j, caps = run_judgement(pj, arms[0], arms[1:], latencies)
    j.notes = notes + j.notes
    errs = []
    for a in arms:  # the simulator's volume beside the measured figures, calibrated on each arm's own steps
        vid, cap = a.variant.variant_id, caps[a.variant.variant_id]
        figures, cal = probe_diagnostics(search, a, calibrated_on[vid], cap, windows.records)
        if "step_drift_on_probes" in figures:
            search.log(f"judge: {a.variant.name}: the probes' steps took {figures['step_drift_on_probes']:.2f}x the "
                       "time the slow tier's calibration predicts for them (the median over runs of four steps)"
                       + drift_kinds(figures))
        if "attainment_error_drift_corrected" in figures:
            search.log(f"judge: {a.variant.name}: the simulator replaying its probes is off by "
                       f"{figures['attainment_error_on_probes']:.2f} attainment per probe, "
                       f"{figures['attainment_error_drift_corrected']:.2f} with each probe's steps at their measured "
                       "speed (" + ", ".join(f"{d:.2f}x" for d in figures["drift_on_probes"]) + ")")
        if cal is not None:
            figures.update(simulated_figures(search, a.variant, cal, jcfg.simulated_requests))
        j.arms[vid].update(figures)
        if "capacity_on_probes" in figures and not cap.censored and cap.estimate > 0:
            errs.append(abs(figures["capacity_on_probes"] - cap.estimate) / cap.estimate)
    j.simulator_probe_error = max(errs) if errs else math.nan
    search.board.post("judge", "note", {"search": search.id, "judgement": j.to_json(), "config": jcfg.to_json()},
                      [r.id for r, _ in [base] + picked])
    search.log("judge: " + j.headline())
    return j


def probe_diagnostics(search, arm, n0: int, cap, records: list) -> tuple[dict, object]:
    """Where the simulator's error on one judged arm comes from: the probes' steps against the time the
    calibration on the arm's first ``n0`` steps predicts (``step_drifts``: the step model), and the
    simulator replaying the judge's own probes with the calibration refitted on every step (``on_probes``: the
    scheduling, with the step model corrected). ``search``: anything with ``model_spec``, ``hardware`` and
    ``cfg.sim``. Returns (those figures, the refitted calibration or None)."""
    from ops.search.worker import calibration_from

    figures = step_drifts(search.model_spec, search.hardware, arm.samples[:n0], arm.samples[n0:], arm.variant)
    cal = calibration_from(search.model_spec, search.hardware, arm.samples, arm.variant)
    if cal is not None:
        steps = {w: arm.samples[a:b] for w, (a, b) in getattr(arm, "spans", {}).items()}
        figures.update(on_probes(search, arm.variant, cal, cap.probes, records, steps))
    return figures, cal


def drift_kinds(figures: dict) -> str:
    """``step_drifts``' sums by kind as a clause of the log's line ("" where neither was measured)."""
    parts = [f"{kind} steps {figures[f'step_drift_{kind}']:.2f}x" for kind in ("decode", "prefill")
             if f"step_drift_{kind}" in figures]
    return f"; summed: {', '.join(parts)}" if parts else ""


def step_drifts(model, hw, calibration: list, later: list, v=None, window: int = 4) -> dict:
    """The ``later`` steps (the judge's probes') measured time over the time the cost model calibrated on
    ``calibration`` (steps as [new tokens, KV tokens, sequences, attended pairs, seconds], run by ``v``) predicts
    for them: ``step_drift_on_probes``, the median over runs of ``window`` consecutive steps (with two runs or
    more); ``step_drift_decode`` and ``step_drift_prefill``, summed apart for steps of decode rows only and steps
    that carry prefill tokens (four or more of a kind). Above 1: the probes ran slower steps than those the
    simulator's capacity was predicted from, which near the knee of the attainment curve moves the measured
    capacity well below the predicted one. The median follows the many decode steps while a request's TTFT waits
    on the prefill steps, so a step model right on decode and short on prefill shows in the sums only. Empty
    with too few steps to calibrate on."""
    from ops.predict.cost_model import step_time
    from ops.search.worker import calibration_from, step_shapes

    cal = calibration_from(model, hw, calibration, v)
    if cal is None:
        return {}
    steps = [(s, t, step_time(model, hw, s, cal, v.tp if v is not None else 1, v)) for s, t in step_shapes(later)]
    out = {}
    if len(steps) >= 2 * window:
        runs = [steps[k:k + window] for k in range(0, len(steps) - window + 1, window)]
        out["step_drift_on_probes"] = statistics.median(sum(t for _, t, _ in r) / sum(p for *_, p in r) for r in runs)
    for kind, picked in (("decode", [x for x in steps if x[0].new_tokens == x[0].seqs]),
                         ("prefill", [x for x in steps if x[0].new_tokens > x[0].seqs])):
        if len(picked) >= 4:
            out[f"step_drift_{kind}"] = sum(t for _, t, _ in picked) / sum(p for *_, p in picked)
    return out


def step_drift(model, hw, calibration: list, later: list, window: int = 4, v=None) -> float | None:
    """``step_drifts``' median over runs of ``window`` steps, or None with too few steps."""
    return step_drifts(model, hw, calibration, later, v, window).get("step_drift_on_probes")


def simulated_figures(search, v: VariantSpec, cal, n: int) -> dict:
    """The simulator's capacity, goodput and attainment at 1x, 1.5x and 2x the traffic's observed rate, and
    the capacity with gamma arrivals of the traffic's fitted burstiness and its length distribution (the
    robustness arm), over ``n`` requests, with ``cal`` (the cost model calibrated on the variant's measured
    steps); and the capacity with every step 10% slower (``capacity_steps_slower``): near the attainment curve's
    knee a small drift in the host's speed moves the capacity several times as much, which is how far a
    simulator's capacity error can come from the steps alone."""
    from ops.predict.cost_model import predicted_capacity, scaled, simulate, synthetic_requests
    from ops.traffic.traces import profile

    model, hw = search.model_spec, search.hardware
    recs = search.bench.sim_records(n)
    sim = {k: x for k, x in search.cfg.sim.items() if k != "time_scale"}
    out = {"simulated_requests": len(recs),
           "capacity_simulated": predicted_capacity(model, hw, recs, v, cal, **search.cfg.sim),
           "capacity_steps_slower": predicted_capacity(model, hw, recs, v, scaled(cal, 1.1), **search.cfg.sim)}
    observed = own_rate(search.bench.records) / search.cfg.time_scale if search.cfg.time_scale > 0 else math.inf
    if math.isfinite(observed) and observed > 0:
        for k in (1.0, 1.5, 2.0):
            p = simulate(model, hw, recs, v, cal, time_scale=own_rate(recs) / (k * observed), **sim)
            out[f"goodput_{k:g}x"] = p.goodput
            out[f"attainment_{k:g}x"] = p.attainment
        out["observed_rate"] = observed
    gamma = synthetic_requests(profile(recs), n=len(recs), seed=1)
    out["interarrival_cv"] = profile(recs).interarrival_cv
    out["capacity_gamma"] = predicted_capacity(model, hw, gamma, v, cal, **search.cfg.sim)
    return out


def on_probes(search, v: VariantSpec, cal, probes: list, records: list, steps: dict | None = None) -> dict:
    """The simulator replaying the judge's own probes of ``v``: each probe's window (``records`` from its index,
    as many as it replayed), its rate, its warm-up and its counted requests, with ``cal`` (calibrated on the
    arm's measured steps). Its capacity over those simulated probes (``capacity_on_probes``) against the measured
    one separates the simulator's model error from the horizon: the prediction replays a thousand requests end to
    end, where a probe counts tens after a short warm-up, before a queue near capacity has grown to its steady state.
    ``attainment_error_on_probes``: the mean |simulated - measured| attainment over the probes;
    ``probes_simulated``: [rate, measured attainment, simulated attainment] per probe. With ``steps`` (a probe's
    window -> its measured steps), each probe is simulated again with every step scaled by that probe's own
    steps' time over the calibration's (the host's speed while it ran; a shared host drifts within a minute):
    ``drift_on_probes`` per probe, ``attainment_error_drift_corrected`` the mean |simulated - measured| then, and
    each ``probes_simulated`` row gains that attainment and the drift. What remains is the scheduling model's error."""
    from ops.measure.capacity import Probe, capacity_of
    from ops.predict.cost_model import scaled, simulate, step_time
    from ops.search.worker import step_shapes

    counted = [p for p in probes if p.verdict != "void" and p.n and p.replayed
               and p.window + p.replayed <= len(records)]
    if not counted:
        return {}
    sim = {k: x for k, x in search.cfg.sim.items() if k != "time_scale"}
    out, diffs, pairs, corrected = [], [], [], []
    for p in counted:
        recs = records[p.window:p.window + p.replayed]
        got = simulate(search.model_spec, search.hardware, recs, v, cal, time_scale=own_rate(recs) / p.rate,
                       counted=(p.warmup, p.warmup + p.n), **sim).attainment
        good = round(got * p.n)
        out.append(Probe(rate=p.rate, outcomes=[1] * good + [0] * (p.n - good), warmup=p.warmup, window=p.window))
        diffs.append(abs(got - p.attainment))
        pairs.append([p.rate, p.attainment, got])
        shapes = step_shapes((steps or {}).get(p.window, []))
        modelled = sum(step_time(search.model_spec, search.hardware, s, cal, v.tp, v) for s, _ in shapes)
        if len(shapes) >= 4 and modelled > 0:
            drift = sum(t for _, t in shapes) / modelled
            again = simulate(search.model_spec, search.hardware, recs, v, scaled(cal, drift),
                             time_scale=own_rate(recs) / p.rate, counted=(p.warmup, p.warmup + p.n), **sim).attainment
            pairs[-1] += [again, drift]
            corrected.append(abs(again - p.attainment))
    cap = capacity_of(out)
    res = {"capacity_on_probes": cap.estimate, "censored_on_probes": cap.censored,
           "attainment_error_on_probes": sum(diffs) / len(diffs), "probes_simulated": pairs}
    if corrected:
        res["attainment_error_drift_corrected"] = sum(corrected) / len(corrected)
        res["drift_on_probes"] = [row[4] for row in pairs if len(row) > 3]
    return res
