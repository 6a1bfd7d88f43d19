"""Workload tuning: the request-size trace from a real trace, the two tiers, the paired ratio's verdicts, the
tuner keeping static-best when no candidate is better (or only a tolerance-mode one is), its time budget and
failure capture, and the bench's partial results."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from engine.workloads import WorkloadVariant, get_workload
from ops.workloads.tiers import BETTER, CENSORED, SAME, WORSE, fast_tier, paired, ratio_of, slow_tier
from ops.workloads.traffic import SizeRequest, SizeTrace, size_trace
from ops.workloads.tune import (BUDGET_SPENT, CANDIDATE_NAMES, Arm, TuneConfig, _measure, candidates,
                                loud_recompile_limit, tune_workload)


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
    gpu = candidates(get_workload("fno"), "cuda", WorkloadVariant(name="static-best", compile_mode="default",
                                                                  max_batch=8))
    names = [v.name for v in gpu]
    assert {"graphs", "tf32", "channels-last", "autotune", "graphs-eager", "graphs-eager-b1"} <= set(names)
    assert names == [n for n in CANDIDATE_NAMES if n in names]  # the measuring order a time budget cuts
    by = {v.name: v for v in gpu}
    assert by["graphs-eager-b1"].cuda_graphs and by["graphs-eager-b1"].compile_mode is None
    assert by["graphs-eager-b1"].max_batch == 1
    eager_graphs = by["graphs-eager"]
    assert eager_graphs.cuda_graphs and eager_graphs.compile_mode is None and eager_graphs.max_batch == 16
    assert eager_graphs.bucket_sizes[-1] == 16
    # a GPU's eager forms run deterministic, as the gate's reference does; the compiled ones as the library has them
    assert all(by[n].deterministic for n in ("eager", "eager-2x", "graphs-eager", "graphs-eager-b1"))
    assert not by["graphs"].deterministic and not any(
        v.deterministic for v in candidates(w, "cpu", WorkloadVariant(name="static-best", max_batch=4)))



def test_triton_ops_is_graphs_eager_with_triton_hot_ops_where_a_workload_has_a_hot_op(monkeypatch):
    static = WorkloadVariant(name="static-best", compile_mode="default", max_batch=8)
    by = {v.name: v for v in candidates(get_workload("fno"), "cuda", static)}
    tri, graphs = by["triton-ops"], by["graphs-eager"]
    assert CANDIDATE_NAMES.index("triton-ops") == CANDIDATE_NAMES.index("graphs-eager") + 1
    assert tri.hot_ops == "triton" and tri.cuda_graphs and tri.compile_mode is None and tri.deterministic
    assert (tri.max_batch, tri.bucket_sizes) == (graphs.max_batch, graphs.bucket_sizes) and not tri.needs_tolerance
    assert "triton-ops" not in {v.name for v in candidates(get_workload("patchtst"), "cuda", static)}
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # and a CPU has no CUDA graphs either way
    assert "triton-ops" not in {v.name for v in candidates(get_workload("fno"), "cpu", static)}

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


def test_paired_rounds_stop_at_the_deadline_after_three():
    assert paired(lambda: 1.0, lambda: 2.0, rounds=6, deadline=0.0).n == 3
    assert paired(lambda: 1.0, lambda: 2.0, rounds=3).n == 3


def test_fewer_than_three_rounds_decide_nothing():
    """Two pairs resample to their two ratios only: no 95% interval, so no verdict of better or worse."""
    two = ratio_of([1.0, 1.1], [2.0, 2.1])
    assert two.n == 2 and two.verdict == SAME and two.low > 1
    assert ratio_of([1.0, 1.1, 0.9], [2.0, 2.1, 1.9]).verdict == BETTER


def test_a_spent_budget_leaves_candidates_unmeasured_and_says_so():
    cfg = TuneConfig(requests=24, mix=8, repeats=1, rounds=2, sweep=(4, 8), gate_batches=(2,), budget_s=1e-3)
    t = tune_workload("patchtst", "cpu", cfg, variants=[WorkloadVariant(name="batch-1", max_batch=1),
                                                        WorkloadVariant(name="bf16", matmul_precision="bf16")])
    assert t.unmeasured == ["batch-1", "bf16"] and all(a.skipped == BUDGET_SPENT and a.gate is None for a in t.arms)
    assert t.static.gate is not None and t.static.fast > 0  # static-best is always measured
    assert list(t.sweep.throughput) == [4] and "stopped before batch 8" in t.sweep.note  # its sweep at one batch
    assert t.exact is None and t.chosen.name == "static-best" and BUDGET_SPENT in t.reason
    j = t.to_json()
    assert j["unmeasured"] == ["batch-1", "bf16"] and j["budget_s"] == 1e-3 and j["arms"][0]["skipped"]
    with pytest.raises(ValueError, match="budget_s"):
        TuneConfig(budget_s=0)
    with pytest.raises(ValueError, match="unknown candidates"):
        TuneConfig(candidates=("eager", "max-autotune"))


def test_any_exception_of_an_arm_is_its_error_with_the_type_and_an_interrupt_is_not(monkeypatch):
    """torch.compile fails with more than RuntimeError (an Inductor assert, Triton's CompilationError): the arm
    records the type; the time it took and the gate's max abs error are recorded when it passes too."""
    import ops.workloads.tune as tune

    w = get_workload("patchtst")
    module = w.build()
    mix = w.make_inputs([1, 3], 0)
    cfg = TuneConfig(repeats=1, gate_batches=(2,))
    ok = Arm(WorkloadVariant(name="bf16", matmul_precision="bf16"))
    _measure(w, ok, module, "cpu", mix, cfg)
    assert ok.error is None and ok.gate.passed and ok.max_abs == ok.gate.max_abs > 0 and ok.seconds > 0
    assert ok.to_json()["max_abs"] == ok.max_abs and ok.to_json()["seconds"] == ok.seconds

    def broken(*a, **k):
        raise AssertionError("inductor: a lowering's invariant")

    monkeypatch.setattr(tune, "gate_workload", broken)
    arm = Arm(WorkloadVariant(name="x", max_batch=2))
    _measure(w, arm, module, "cpu", mix, cfg)
    assert arm.error == "AssertionError: inductor: a lowering's invariant" and arm.seconds >= 0

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(tune, "gate_workload", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _measure(w, Arm(WorkloadVariant(name="y")), module, "cpu", mix, cfg)


def test_the_recompile_limit_raises_inside_a_tuning_only():
    import torch._dynamo.config as config

    before = config.fail_on_recompile_limit_hit
    with loud_recompile_limit():
        assert config.fail_on_recompile_limit_hit
    assert config.fail_on_recompile_limit_hit == before


def test_bench_writes_json_after_each_model_and_keeps_going_past_a_failure(tmp_path, monkeypatch, capsys):
    """The GPU run is one command under a hard time limit: each model's figures reach the JSON file (and stdout)
    as soon as it is done, a model that raises is a row, and --candidates keeps the named candidates only."""
    import json

    import bench.workloads as bw
    from bench.lib import cli

    writes = []
    real = bw.write_json
    monkeypatch.setattr(bw, "write_json", lambda path, entries: (writes.append(len(entries)), real(path, entries)))
    out = tmp_path / "w.json"
    rc = cli.run(bw.__doc__, bw.add_cli_args, bw.main, ["--models", "patchtst,resnet", "--no-compile", "--requests",
                                                        "16", "--rounds", "2", "--candidates", "eager-2x",
                                                        "--budget-seconds", "600", "--json", str(out)])
    assert rc == 0 and writes[:2] == [1, 2]
    entries = json.loads(out.read_text())
    assert entries[0]["workload"] == "patchtst" and [a["variant"]["name"] for a in entries[0]["arms"]] == ["eager-2x"]
    assert entries[0]["budget_s"] and entries[0]["arms"][0]["seconds"] > 0 and entries[0]["sweep"]["throughput"]
    assert entries[1]["workload"] == "resnet" and entries[1]["error"].startswith("ValueError: unknown workload")
    printed = capsys.readouterr().out
    assert printed.index("patchtst: chosen") < printed.index("resnet: failed")
    assert cli.run(bw.__doc__, bw.add_cli_args, bw.main, ["--candidates", "fastest"]) == 2


def test_warm_up_serves_every_group_size_per_request_size():
    """The slow tier's groups depend on timing; the untimed warm-up shows a compiled or graphed runner each batch
    shape first: every count up to the batch per size (equal sizes), prefixes and suffixes (concatenation)."""
    from engine.workloads import build_runner
    from ops.workloads.tiers import warm_up

    for name, sizes, cap in (("fno", [32, 48, 32], 2), ("patchtst", [1, 3, 7], 3)):
        w = get_workload(name)
        module = w.build()
        runner = build_runner(w, WorkloadVariant(max_batch=cap), module, "cpu")
        seen = []
        runner.forward = lambda **batch: (seen.append(tuple(next(iter(batch.values())).shape[:2])), module(**batch))[1]
        warm_up(runner, w.make_inputs(sizes, 0))
        if name == "fno":
            assert sorted(set(seen)) == [(1, 10), (2, 10)] and len(seen) == 4  # counts 1 and 2 at sizes 32 and 48
        else:
            assert sorted(n for n, _ in seen) == [1, 4, 7, 10, 11]  # series: 1, 7; 1+3, 3+7; 1+3+7


def test_the_slow_tier_saturates_both_arms_and_holds_enough_work():
    """A candidate 3x static-best's speed replayed at twice static-best's rate would keep up with the arrivals
    and measure the offered rate, not its capacity: the replay runs at the load times the faster arm's speed.
    A model served in microseconds needs more requests than the default slice for a replay of half a second."""
    from ops.workloads.tune import _long_enough, saturating

    w = get_workload("patchtst")
    trace = size_trace(w, 24)
    cfg = TuneConfig(requests=24, load=2.0, busy_s=0.5)
    assert saturating(trace, cfg, 100.0, 300.0).rate == pytest.approx(600.0)
    assert saturating(trace, cfg, 100.0, 0.0).rate == pytest.approx(200.0)  # an unmeasured arm: the other's
    assert saturating(trace, cfg, 0.0, 0.0) is trace
    longer = _long_enough(w, trace, False, 1000.0, cfg)
    assert len(longer.requests) == 500 and longer.requests[:24] == trace.requests
    assert _long_enough(w, trace, False, 10.0, cfg) is trace  # already 2.4 s of work
    assert _long_enough(w, trace, True, 1000.0, cfg) is trace  # a trace the caller gave is kept


def test_static_best_is_swept_once_per_device_and_then_taken_from_its_record(tmp_path, monkeypatch):
    """A sweep recorded for this kind of device is taken as it is (its batch, its figures, named so) instead of
    compiling every batch again; a sweep that runs with ``record`` writes that entry; a CPU never takes a GPU's."""
    import importlib

    from ops.workloads.tune import find_static_best

    sb = importlib.import_module("engine.workloads.static_best")  # the package exports the function of that name

    monkeypatch.setenv("POLYINF_WORKLOAD_STATIC_BEST", str(tmp_path / "sb.json"))
    assert sb.lookup("patchtst", "cpu") is None
    gpu = {"workload": "patchtst", "device": "NVIDIA H100 80GB HBM3", "max_batch": 16, "compile": True,
           "throughput": {"16": 1.0}, "date": "2026-12-06", "torch": "2.11"}
    (tmp_path / "sb.json").write_text(json.dumps({"entries": [gpu]}))
    assert sb.lookup("patchtst", "cpu") is None  # a CPU never takes a GPU's static-best
    w = get_workload("patchtst")
    module = w.build()
    cfg = TuneConfig(mix=4, repeats=1, sweep=(2, 4), record=True)
    swept = find_static_best(w, module, "cpu", cfg)
    assert not swept.recorded and set(swept.throughput) == {2, 4} and swept.seconds > 0
    entry = sb.lookup("patchtst", "cpu")
    assert entry["device"] == "cpu" and entry["max_batch"] == swept.variant.max_batch and not entry["compile"]
    assert {int(b) for b in entry["throughput"]} == {2, 4}
    assert entry["batches"] == [2, 4]
    sb.record("patchtst", "cpu", 8, False, {8: 123.4, 2: 50.0}, [2, 4, 8])  # replaces the entry, keeps the other
    again = find_static_best(w, module, "cpu", replace(cfg, record=False))
    assert again.recorded == "cpu" and again.variant.max_batch == 8 and again.throughput == {2: 50.0, 8: 123.4}
    assert "recorded on cpu" in again.note and again.variant.compile_mode is None
    assert [e["device"] for e in json.loads((tmp_path / "sb.json").read_text())["entries"]] == \
        ["NVIDIA H100 80GB HBM3", "cpu"]
    good = (tmp_path / "sb.json").read_text()
    (tmp_path / "sb.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a static-best record"):
        sb.lookup("patchtst", "cpu")
    (tmp_path / "sb.json").write_text(good)
    fresh = find_static_best(w, module, "cpu", replace(cfg, record=False, recorded=False, sweep=(2,)))
    assert not fresh.recorded and set(fresh.throughput) == {2}  # --sweep: the record is not taken
    wider = find_static_best(w, module, "cpu", replace(cfg, record=False, sweep=(1, 2)))
    assert not wider.recorded and set(wider.throughput) == {1, 2}  # the record does not cover batch 1: swept
    before = (tmp_path / "sb.json").read_text()
    cut = find_static_best(w, module, "cpu", replace(cfg, sweep=(1, 2, 4), recorded=False), until=0.0)
    assert set(cut.throughput) == {1} and "stopped before" in cut.note
    assert (tmp_path / "sb.json").read_text() == before  # a sweep the budget cut short is not recorded
