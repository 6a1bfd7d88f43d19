"""Workload tuning: the request-size trace from a real trace, the two tiers, the paired ratio's verdicts, and the
tuner keeping static-best when no candidate is better (or only a tolerance-mode one is)."""
from __future__ import annotations

import math

import pytest

from engine.workloads import WorkloadVariant, get_workload
from ops.workloads.tiers import BETTER, CENSORED, SAME, WORSE, fast_tier, ratio_of, slow_tier
from ops.workloads.traffic import SizeRequest, SizeTrace, size_trace
from ops.workloads.tune import TuneConfig, candidates, tune_workload


def test_size_trace_maps_prompt_lengths_to_levels_deterministically():
    w = get_workload("fno")
    a, b = size_trace(w, 300, start=100), size_trace(w, 300, start=100)
    assert a == b and a.source.endswith("#100-399")
    assert set(a.sizes) <= set(w.size_levels) and len(set(a.sizes)) == len(w.size_levels)
    assert all(0.05 < share < 0.4 for share in a.mix().values())  # equally likely bins, a slice drifts a little
    arrivals = [r.arrival_s for r in a.requests]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals) and 1 < a.rate < 20  # Azure: about 5.5 req/s
    fast = a.scaled(50.0)
    assert math.isclose(fast.rate, 50.0) and fast.sizes == a.sizes
    with pytest.raises(ValueError, match="asked for"):
        size_trace(w, 10, start=10**6)
    with pytest.raises(ValueError, match="at least one request"):
        SizeTrace("fno", "none", ())


def test_slow_tier_replays_every_request_through_the_policy():
    w = get_workload("patchtst")
    module = w.build()
    from engine.workloads import build_runner

    trace = SizeTrace("patchtst", "test", tuple(SizeRequest(0.001 * i, s) for i, s in enumerate([1, 3, 7, 1, 12, 3])))
    requests = w.make_inputs(trace.sizes, 1)
    runner = build_runner(w, WorkloadVariant(max_batch=4), module, "cpu")
    r = slow_tier(runner, trace, requests)
    assert r.requests == 6 and 2 <= r.forwards <= 6 and r.throughput > 0 and 0 < r.p50 <= r.p90 <= r.p99
    one = slow_tier(build_runner(w, WorkloadVariant(max_batch=1), module, "cpu"), trace, requests)
    assert one.forwards == 6
    assert fast_tier(runner, requests, repeats=1) > 0
    with pytest.raises(ValueError, match="inputs for a trace"):
        slow_tier(runner, trace, requests[:2])


def test_ratio_verdicts_use_the_judges_words():
    assert ratio_of([1.0, 1.1, 0.9, 1.0], [2.0, 2.1, 1.9, 2.0]).verdict == BETTER
    assert ratio_of([2.0, 2.1, 1.9, 2.0], [1.0, 1.1, 0.9, 1.0]).verdict == WORSE
    same = ratio_of([1.0, 1.2, 0.9, 1.1], [1.1, 1.0, 1.0, 1.05])
    assert same.verdict == SAME and same.low < 1 < same.high and same.n == 4
    assert ratio_of([], []).verdict == CENSORED and "no ratio" in ratio_of([], []).line()


def test_cpu_candidates_leave_out_what_the_cpu_refuses():
    w = get_workload("weather_gnn")
    names = {v.name for v in candidates(w, "cpu", WorkloadVariant(name="static-best", max_batch=4))}
    assert "bf16" in names and "eager-2x" in names
    assert not names & {"graphs", "tf32", "reduce-overhead", "channels-last"}  # GPU only; not an image model
    gpu = {v.name for v in candidates(get_workload("fno"), "cuda", WorkloadVariant(compile_mode="default"))}
    assert {"graphs", "tf32", "channels-last", "autotune"} <= gpu


def test_tuner_keeps_static_best_when_no_candidate_is_better():
    """Batch 1 is slower than static-best's swept batch, and bf16 passes only tolerance mode: static-best stays."""
    cfg = TuneConfig(requests=24, mix=8, repeats=1, rounds=3, sweep=(4, 8), gate_batches=(2,), gate_rounds=1)
    t = tune_workload("patchtst", "cpu", cfg, variants=[WorkloadVariant(name="batch-1", max_batch=1),
                                                        WorkloadVariant(name="bf16", matmul_precision="bf16")])
    assert t.chosen.name == "static-best" and t.chosen.max_batch in (4, 8)
    batch1, bf16 = t.arms
    assert batch1.exact and not bf16.exact and bf16.tolerable
    assert t.exact.arm is batch1 and t.exact.ratio.n == 3 and t.exact.ratio.verdict != BETTER
    assert "static-best stays" in t.reason
    assert t.static.exact  # static-best on the CPU (eager, batched) is bit-exact itself
    assert t.to_json()["chosen"]["variant_id"] == t.chosen.variant_id
