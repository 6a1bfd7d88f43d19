"""The cost model: its error measures against scipy, calibration recovering known factors, the
simulation against the engine's own scheduler, and the plan's ranking of knobs and layouts."""
from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from engine.serving.trace_record import TraceRecord
from engine.config.variant import VariantSpec
from ops.predict.cost_model import (ROOFLINE, Calibration, StepShape, calibrate, features, mape, plan, rank_layouts,
                            simulate, spearman, step_time, synthetic_requests)
from ops.measure.hardware import HardwareProfile
from ops.measure.model_spec import ModelSpec
from ops.traffic.traces import profile

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "traces" / "AzureLLMInferenceTrace_conv.csv"

SPEC = ModelSpec(architecture="llama", layers=30, hidden_size=576, heads=9, kv_heads=3, head_dim=64, vocab=49152,
                 experts=0, experts_per_token=0, dtype="float32", param_bytes=4 * 134_515_008,
                 kv_bytes_per_token=2 * 30 * 3 * 64 * 4, weights_hash="x", source="x")
HW = HardwareProfile(device="test", device_count=1, memory_bytes=24 << 30, memory_bandwidth=40e9,
                     matmul_flops={"float32": 3e11}, launch_overhead_s=3e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_spearman_and_mape_match_references(seed):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=25).round(1)  # rounding makes ties
    b = a + rng.normal(scale=0.8, size=25).round(1)
    assert spearman(list(a), list(b)) == pytest.approx(stats.spearmanr(a, b).statistic, abs=1e-12)
    p, m = rng.uniform(1, 10, 12), rng.uniform(1, 10, 12)
    assert mape(list(p), list(m)) == pytest.approx(float(np.mean(np.abs(p - m) / m)))
    assert np.isnan(spearman([1, 1, 1], [1, 2, 3]))
    with pytest.raises(ValueError):
        spearman([1.0], [2.0])


def test_calibration_recovers_known_factors():
    rng = random.Random(3)
    truth = Calibration(mem=1.7, compute=0.6, launch=25.0, per_seq_s=4e-4, fitted=True)
    shapes = [StepShape.prefill(rng.randint(8, 1024)) for _ in range(12)]
    shapes += [StepShape.decode(rng.randint(1, 64), rng.randint(16, 2048)) for _ in range(12)]
    samples = [(s, step_time(SPEC, HW, s, truth) * (1 + rng.uniform(-0.002, 0.002))) for s in shapes]
    cal = calibrate(SPEC, HW, samples)
    assert cal.fitted and cal.samples == 24 and cal.fit_mape < 0.01
    for name in ("mem", "compute", "launch", "per_seq_s"):
        assert getattr(cal, name) == pytest.approx(getattr(truth, name), rel=0.05), name
    # the factors stay non-negative even when the data would prefer a negative one
    cal = calibrate(SPEC, HW, [(s, 0.01) for s in shapes])
    assert min(cal.mem, cal.compute, cal.launch, cal.per_seq_s) >= 0
    assert calibrate(SPEC, HW, []) == ROOFLINE
    with pytest.raises(ValueError):
        calibrate(SPEC, HW, [(shapes[0], 0.0)])


def test_roofline_step_time_is_the_larger_bound_plus_launches():
    mem, comp, launch, _, eager = features(SPEC, HW, StepShape.decode(1, 100))
    assert step_time(SPEC, HW, StepShape.decode(1, 100)) == pytest.approx(max(mem, comp) + launch)
    assert mem > comp and eager == 0  # batch-1 decode is memory-bound; no variant given: no eager launches
    mem, comp, _, _, _ = features(SPEC, HW, StepShape.prefill(2048))
    assert comp > mem  # a long prefill is compute-bound
    m1, _, l1, _, _ = features(SPEC, HW, StepShape.decode(8, 100), tp=1)
    m2, _, l2, _, _ = features(SPEC, HW, StepShape.decode(8, 100), tp=2)
    assert m2 == pytest.approx(m1 / 2) and l2 > l1  # TP halves bytes per device, adds all-reduces


@pytest.fixture(scope="module")
def one_layer():
    """SmolLM2's first layer, loaded once for the module's engines."""
    from engine import EngineConfig, LLMEngine, resolve

    return LLMEngine(EngineConfig(source=resolve("smollm2"), layers=1, num_kv_blocks=256, load_tokenizer=False))


@pytest.mark.parametrize("knobs", [{}, {"max_num_seqs": 3}, {"max_num_batched_tokens": 40},
                                   {"prefill_chunk_size": 16, "max_num_batched_tokens": 64}])
def test_simulation_schedules_like_the_engine(knobs, one_layer):
    """All requests arriving at once: the simulated steps batch exactly the tokens and sequences the
    real engine's scheduler does (read from the slow tier's per-step record)."""
    from engine import LLMEngine
    from ops.measure.tiers import slow_tier
    from ops.traffic.replay import synthesize_prompts
    from ops.traffic.traces import load_trace

    records = load_trace(TRACE)[:7]
    v = dataclasses.replace(VariantSpec(), **knobs)
    eng = LLMEngine.with_loaded(one_layer, dataclasses.replace(one_layer.config, variant=v))
    prompts = synthesize_prompts(records, eng.model_config.vocab_size, max_input=48)
    res = slow_tier(eng, records, prompts, "t", repeats=1, time_scale=0.0, max_output=5)
    measured = [(int(n), int(s)) for n, _, s, _, _ in res.step_samples]
    shapes: list[StepShape] = []
    simulate(SPEC, HW, records, v, time_scale=0.0, max_input=48, max_output=5, num_kv_blocks=256, steps_out=shapes)
    assert [(s.new_tokens, s.seqs) for s in shapes] == measured


def test_simulation_prefix_caching_saves_prefill():
    recs = [TraceRecord(arrival_s=i * 10.0, input_tokens=512, output_tokens=4, prefix_block_hashes=[1, 2, 3, 4],
                        block_tokens=128, source="t") for i in range(4)]
    on, off = [], []
    simulate(SPEC, HW, recs, VariantSpec(), steps_out=on)
    simulate(SPEC, HW, recs, VariantSpec(enable_prefix_caching=False), steps_out=off)
    # as the engine's block manager does: whole blocks are reused, all but the last (a step must compute a token)
    assert sum(s.new_tokens for s in off) - sum(s.new_tokens for s in on) == 3 * (512 - 16)


def test_plan_ranks_knobs_and_layouts():
    prof = profile(synthetic_requests(profile([TraceRecord(arrival_s=float(i), input_tokens=300 + 50 * i,
                                                           output_tokens=40, source="t") for i in range(20)]), 32))
    base = VariantSpec(name="base")
    p = plan(SPEC, HW, prof, base, max_output=16)
    keys = [(-round(e.prediction.capacity, 6), -round(e.prediction.attainment, 6), -round(e.prediction.output_tok_s, 6))
            for e in p.entries]
    assert keys == sorted(keys)
    assert p.ranges["max_num_seqs"] and set(p.ranges["max_num_seqs"]) <= {1, 4, 16, 64}
    assert p.entries[0].prediction.output_tok_s >= p.entries[-1].prediction.output_tok_s
    two = dataclasses.replace(HW, device_count=2, interconnect_bandwidth=400e9)
    assert not next(d for d in rank_layouts(SPEC, two, prof, base, 2) if d["tp"] == 2)["fits"]  # 9 heads
    spec = dataclasses.replace(SPEC, heads=8, kv_heads=2)
    layouts = rank_layouts(spec, two, prof, base, 2, max_output=16)
    assert {(d["tp"], d["dp"]) for d in layouts} == {(1, 2), (2, 1)}
    assert all(d["fits"] for d in layouts)
    tp2 = next(d for d in layouts if d["tp"] == 2)
    assert tp2["prediction"]["output_tok_s"] > 0
    half = dataclasses.replace(two, memory_bytes=int(spec.param_bytes / 1.5))  # the weights fit only split in two
    assert [(d["tp"], d["fits"]) for d in rank_layouts(spec, half, prof, base, 2)] == [(2, True), (1, False)]


def test_calibration_over_windows_survives_steps_a_call_early():
    """An engine that runs a step ahead spends a step's time one call early: windows of steps fit anyway."""
    rng = random.Random(5)
    truth = Calibration(mem=1.2, compute=0.8, launch=10.0, per_seq_s=2e-4, fitted=True)
    shapes = [StepShape.decode(rng.randint(1, 32), rng.randint(16, 1024)) for _ in range(64)]
    times = [step_time(SPEC, HW, s, truth) for s in shapes]
    shifted = [(s, t) for s, t in zip(shapes, times[1:] + [times[0]])]  # each time reported one step early
    assert calibrate(SPEC, HW, shifted, window=8).fit_mape < 0.05
    assert calibrate(SPEC, HW, shifted, window=8).mem == pytest.approx(1.2, rel=0.25)


def test_step_drift_measures_later_steps_against_the_calibration():
    from ops.search.judge_search import step_drift

    rng = random.Random(5)
    truth = Calibration(mem=1.4, compute=0.7, launch=20.0, per_seq_s=3e-4, fitted=True)

    def steps(n, factor):
        out = []
        for _ in range(n):
            s = (StepShape.prefill(rng.randint(16, 512)) if rng.random() < 0.3
                 else StepShape.decode(rng.randint(1, 16), rng.randint(16, 512)))
            t = step_time(SPEC, HW, s, truth) * factor * (1 + rng.uniform(-0.01, 0.01))
            out.append([s.new_tokens, s.kv_tokens, s.seqs, s.attn_pairs, t])
        return out

    calibration = steps(60, 1.0)
    assert step_drift(SPEC, HW, calibration, steps(40, 1.0)) == pytest.approx(1.0, abs=0.03)
    # later steps 30% slower than those the calibration saw (another load, a busier host): the drift says so
    assert step_drift(SPEC, HW, calibration, steps(40, 1.3)) == pytest.approx(1.3, abs=0.04)
    assert step_drift(SPEC, HW, calibration, steps(7, 1.3)) is None  # fewer than two runs of four steps
    assert step_drift(SPEC, HW, calibration[:5], steps(40, 1.0)) is None  # too few steps to calibrate on


def test_step_drifts_find_prefill_steps_slower_than_the_calibration_says():
    """Later prefill steps 1.5x the calibrated time, decode steps as calibrated: the per-kind sums say so, where
    the median over runs of four steps (mostly decode) stays near 1."""
    from ops.search.judge_search import drift_kinds, step_drift, step_drifts

    rng = random.Random(11)
    truth = Calibration(mem=1.2, compute=0.8, launch=15.0, per_seq_s=2e-4, fitted=True)

    def steps(n, prefill_factor):
        out = []
        for _ in range(n):
            prefill = rng.random() < 0.15
            s = StepShape.prefill(rng.randint(64, 512)) if prefill else StepShape.decode(rng.randint(1, 16), 256)
            t = step_time(SPEC, HW, s, truth) * (prefill_factor if prefill else 1.0) * (1 + rng.uniform(-0.01, 0.01))
            out.append([s.new_tokens, s.kv_tokens, s.seqs, s.attn_pairs, t])
        return out

    calibration, later = steps(80, 1.0), steps(80, 1.5)
    got = step_drifts(SPEC, HW, calibration, later)
    assert got["step_drift_decode"] == pytest.approx(1.0, abs=0.03)
    assert got["step_drift_prefill"] == pytest.approx(1.5, abs=0.05)
    assert step_drift(SPEC, HW, calibration, later) < 1.2
    assert drift_kinds(got) == f"; summed: decode steps {got['step_drift_decode']:.2f}x, prefill steps " \
                               f"{got['step_drift_prefill']:.2f}x"
    assert step_drifts(SPEC, HW, calibration[:5], later) == {}  # too few steps to calibrate on
    assert "step_drift_prefill" not in step_drifts(SPEC, HW, calibration, [r for r in later if r[0] == r[2]])
    assert got["step_drift_on_probes"] == step_drift(SPEC, HW, calibration, later)


def test_eager_steps_beside_graphed_ones_get_their_own_launch_factor():
    """On a GPU a variant's decode steps replay as CUDA graphs while its prefill chunks run eagerly and pay the host
    every kernel's launch (a constant whatever the chunk's length). Calibrated with the variant, the model tells the
    two apart and predicts a short eager chunk to within a few percent; one launch factor for both (no variant, as
    before) misses it badly. With no graphed step (or on a CPU) the fit is the old one."""
    from ops.predict.cost_model import graphed

    gpu = dataclasses.replace(HW, device="cuda:0", memory_bandwidth=3e12, matmul_flops={"float32": 4e14},
                              launch_overhead_s=4e-6)
    v = VariantSpec(name="graphs", cuda_graph_batch_sizes=(1, 2, 4, 8, 16, 32), prefill_chunk_size=512)
    truth = Calibration(mem=1.3, compute=0.9, launch=1.0, per_seq_s=5e-5, eager=12.0, fitted=True)
    rng = random.Random(3)

    def step(s):
        return s, step_time(SPEC, gpu, s, truth, 1, v) * (1 + rng.uniform(-0.01, 0.01))
    shapes = [StepShape.decode(rng.randint(1, 32), rng.randint(64, 1024)) for _ in range(120)]
    shapes += [StepShape.prefill(rng.choice([16, 48, 200, 512])) for _ in range(24)]
    rng.shuffle(shapes)
    samples = [step(s) for s in shapes]
    assert not graphed(SPEC, v, StepShape.prefill(16)) and graphed(SPEC, v, StepShape.decode(32, 100))
    assert not graphed(SPEC, v, StepShape.decode(33, 100))
    short = StepShape.prefill(16)
    with_v = calibrate(SPEC, gpu, samples, v=v)
    assert with_v.eager > 0 and with_v.fit_mape < 0.03
    true_short = step_time(SPEC, gpu, short, truth, 1, v)
    assert step_time(SPEC, gpu, short, with_v, 1, v) == pytest.approx(true_short, rel=0.05)
    one_factor = calibrate(SPEC, gpu, samples)
    assert one_factor.eager == 0
    assert abs(step_time(SPEC, gpu, short, one_factor) / true_short - 1) > 0.2
    # the prefill graphs make every step a graph: no eager column to fit, as on a CPU
    graphs = dataclasses.replace(v, prefill_graph_tokens=(128, 512), prefill_chunk_size=512)
    assert graphed(SPEC, graphs, short) and calibrate(SPEC, gpu, samples, v=graphs).eager == 0
    assert calibrate(SPEC, HW, samples, v=v).eager == 0
    moe = dataclasses.replace(SPEC, experts=8, experts_per_token=2)
    assert not graphed(moe, graphs, short)  # step graphs are a dense model's only


def test_a_graphed_prefill_step_computes_its_padded_rows():
    """A GPU step with prefill tokens replayed as a graph is padded to the next captured count: its projections'
    flops are the padded rows', its attention's and bytes its own; eager steps, decode steps, a CPU and a step past
    the largest graph compute their own tokens. A calibration over padded steps then predicts a step that pads far
    (600 tokens in the 1,024-token graph) where one fit on unpadded counts does not."""
    from ops.predict.cost_model import padded_rows

    gpu = dataclasses.replace(HW, device="cuda:0", memory_bandwidth=3e12, matmul_flops={"float32": 4e14},
                              launch_overhead_s=4e-6)
    v = VariantSpec(name="graphs", cuda_graph_batch_sizes=(1, 2, 4, 8), prefill_graph_tokens=(128, 256, 1024),
                    prefill_chunk_size=1024)
    mixed = StepShape(new_tokens=300, kv_tokens=900, seqs=4, attn_pairs=5000)
    assert padded_rows(SPEC, gpu, mixed, v) == 1024 and padded_rows(SPEC, gpu, StepShape.prefill(128), v) == 128
    assert padded_rows(SPEC, gpu, StepShape.prefill(129), v) == 256
    assert padded_rows(SPEC, HW, mixed, v) == 300  # a CPU: no graphs
    assert padded_rows(SPEC, gpu, StepShape.decode(3, 100), v) == 3  # decode rows: their own graphs
    assert padded_rows(SPEC, gpu, StepShape.prefill(2000), v) == 2000  # past the largest: eager
    eager = dataclasses.replace(v, prefill_graph_tokens=())
    assert padded_rows(SPEC, gpu, mixed, eager) == 300 and padded_rows(SPEC, gpu, mixed, None) == 300
    mem, comp, *_ = features(SPEC, gpu, mixed, 1, v)
    mem0, comp0, *_ = features(SPEC, gpu, mixed, 1, eager)
    params = SPEC.param_bytes / 4
    attn = 4 * SPEC.layers * SPEC.heads * SPEC.head_dim * mixed.attn_pairs
    assert comp == pytest.approx((2 * params * 1024 + attn) / 4e14) and comp0 == pytest.approx((2 * params * 300 + attn) / 4e14)
    assert mem == mem0
    # steps measured as the padded graphs run them: the variant's calibration predicts a far-padded step
    truth = Calibration(mem=1.2, compute=1.5, launch=1.0, per_seq_s=2e-5, fitted=True)
    rng = random.Random(5)
    shapes = [StepShape.prefill(rng.choice([100, 128, 200, 256, 1000, 1024])) for _ in range(60)]
    shapes += [StepShape.decode(rng.randint(1, 8), rng.randint(64, 1024)) for _ in range(60)]
    samples = [(s, step_time(SPEC, gpu, s, truth, 1, v) * (1 + rng.uniform(-0.01, 0.01))) for s in shapes]
    far = StepShape.prefill(600)
    true_far = step_time(SPEC, gpu, far, truth, 1, v)
    assert step_time(SPEC, gpu, far, calibrate(SPEC, gpu, samples, v=v), 1, v) == pytest.approx(true_far, rel=0.05)


def _steps_run_ahead(one_layer, arrivals: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """The CPU engine with run-ahead on, driven by hand: each (call, prompt tokens, output tokens) added before
    that ``step()`` call; (tokens run, rows out) per call."""
    from engine import LLMEngine, SamplingParams

    eng = LLMEngine.with_loaded(one_layer, dataclasses.replace(one_layer.config, async_decode=True,
                                                               variant=VariantSpec()))
    run: dict[str, int] = {}
    out, call = [], 0
    while True:
        for k, (at, n, o) in enumerate(arrivals):
            if at == call:
                eng.add_request([100 * (k + 1) + j for j in range(n)], SamplingParams(max_tokens=o, ignore_eos=True))
        if not eng.has_unfinished() and call > max(a for a, _, _ in arrivals):
            return out
        new, outs = 0, eng.step()
        for o in outs:
            new += o.num_tokens_run - run.get(o.request_id, 0)
            run[o.request_id] = o.num_tokens_run
        if outs:
            out.append((new, len(outs)))
        call += 1


@pytest.mark.parametrize("late", range(2, 9))
def test_a_step_launched_ahead_admits_an_arrival_as_the_engine_does(late, one_layer):
    """On a GPU the engine launches a decode step's successor, with the same rows, before reading its tokens
    (run-ahead): a request that arrives meanwhile joins the step after next, unless a row finished (the step
    launched ahead then runs it dead and the next is scheduled afresh). Driven by hand on the CPU with run-ahead
    on, the engine's steps and the simulator's (each step 1 s; a third request arriving during step ``late`` - 1,
    before, at and after the second one's end) batch the same tokens."""
    measured = _steps_run_ahead(one_layer, [(0, 32, 12), (0, 16, 4), (late, 8, 3)])
    recs = [TraceRecord(arrival_s=0.0, input_tokens=32, output_tokens=12, source="t"),
            TraceRecord(arrival_s=0.0, input_tokens=16, output_tokens=4, source="t"),
            TraceRecord(arrival_s=late - 0.5, input_tokens=8, output_tokens=3, source="t")]
    gpu = dataclasses.replace(HW, device="cuda:0")
    unit = Calibration(mem=0.0, compute=0.0, launch=1.0 / (12 * SPEC.layers * gpu.launch_overhead_s), per_seq_s=0.0,
                       fitted=True)  # 1 s a step
    ahead, plain = [], []
    simulate(SPEC, gpu, recs, VariantSpec(), unit, steps_out=ahead)
    simulate(SPEC, gpu, recs, VariantSpec(), unit, steps_out=plain, run_ahead=False)
    assert [(s.new_tokens, s.seqs) for s in ahead] == measured
    if late == 7:  # in the middle of the first one's decode alone: prefilled a step later than without run-ahead
        first = next(i for i, (n, _) in enumerate(measured) if i and n > 2)
        assert first == next(i for i, s in enumerate(plain) if i and s.new_tokens > 2) + 1


def test_a_dead_row_of_a_step_launched_ahead_costs_its_time():
    """Every row of a step launched ahead finished the step before: the engine still runs it (dead) before the
    next request's step, and the simulator's clock counts it."""
    gpu = dataclasses.replace(HW, device="cuda:0")
    unit = Calibration(mem=0.0, compute=0.0, launch=1.0 / (12 * SPEC.layers * gpu.launch_overhead_s), per_seq_s=0.0,
                       fitted=True)
    recs = [TraceRecord(arrival_s=0.0, input_tokens=16, output_tokens=3, source="t"),
            TraceRecord(arrival_s=2.5, input_tokens=16, output_tokens=2, source="t")]
    ahead = simulate(SPEC, gpu, recs, VariantSpec(), unit)
    plain = simulate(SPEC, gpu, recs, VariantSpec(), unit, run_ahead=False)
    # steps at 0 (prefill), 1, 2 (the last token, its successor launched ahead at 2 and run dead 3-4), 4: 1 s later
    assert ahead.wall_s == pytest.approx(plain.wall_s + 1.0)
    # a variant that may draft at this batch never runs ahead (the next step goes through the scheduler)
    spec = VariantSpec(speculative_tokens=4, speculative_max_batch=8)
    assert simulate(SPEC, gpu, recs, spec, unit).wall_s == simulate(SPEC, gpu, recs, spec, unit, run_ahead=False).wall_s


def test_simulated_figures_show_how_far_slower_steps_move_the_capacity():
    """The judge prints, beside the simulator's capacity, its capacity with every step 10% slower: lower, and by
    more than 10% where the SLO's knee is steep; the judgement's lines carry it as a signed percentage."""
    from types import SimpleNamespace

    from ops.judge.rule import Judgement
    from ops.search.judge_search import simulated_figures
    from ops.traffic.traces import load_trace

    records = load_trace(TRACE)[:120]
    cal = Calibration(mem=1.2, compute=0.8, launch=15.0, per_seq_s=2e-4, fitted=True)
    sim = {"time_scale": 1.0, "max_input": 256, "max_output": 16, "num_kv_blocks": 512, "slo_ttft_s": 0.25,
           "slo_tpot_s": 0.05, "slo_ttft_per_token_s": 0.0}
    search = SimpleNamespace(model_spec=SPEC, hardware=HW, cfg=SimpleNamespace(sim=sim, time_scale=1.0),
                             bench=SimpleNamespace(records=records[:16], sim_records=lambda n: records[:n]))
    got = simulated_figures(search, VariantSpec(), cal, 120)
    assert 0 < got["capacity_steps_slower"] < got["capacity_simulated"]
    change = got["capacity_steps_slower"] / got["capacity_simulated"] - 1
    j = Judgement("a", "a", "censored", "", arms={"a": {"name": "static-best", **got}})
    assert any(f"every step 10% slower: {got['capacity_steps_slower']:.3f} req/s ({change:+.0%})" in line
               for line in j.lines())


def test_on_probes_with_each_probes_own_step_speed_leaves_the_scheduling_error():
    """Probes whose host ran every step 1.3x the calibrated time (a shared host's drift): the simulator replaying
    them with the calibration misses their attainment; scaled by each probe's measured steps it matches them."""
    from types import SimpleNamespace

    from ops.measure.capacity import Probe
    from ops.measure.tiers import own_rate
    from ops.predict.cost_model import scaled
    from ops.search.judge_search import on_probes
    from ops.traffic.traces import load_trace

    records = load_trace(TRACE)[:400]
    cal = Calibration(mem=1.2, compute=0.8, launch=15.0, per_seq_s=2e-4, fitted=True)
    sim = {"max_input": 256, "max_output": 16, "num_kv_blocks": 512, "slo_ttft_s": 0.6, "slo_tpot_s": 0.06,
           "slo_ttft_per_token_s": 0.0}
    search = SimpleNamespace(model_spec=SPEC, hardware=HW, cfg=SimpleNamespace(sim={"time_scale": 1.0, **sim}))
    v, slow = VariantSpec(), scaled(cal, 1.3)
    probes, steps = [], {}
    for w, rate in ((0, 0.5), (60, 1.0), (120, 2.0), (180, 3.0)):
        recs = records[w:w + 44]
        shapes: list[StepShape] = []
        got = simulate(SPEC, HW, recs, v, slow, time_scale=own_rate(recs) / rate, counted=(4, 44), steps_out=shapes,
                       **sim).attainment
        good = round(got * 40)
        probes.append(Probe(rate=rate, outcomes=[1] * good + [0] * (40 - good), warmup=4, window=w, replayed=44,
                            verdict="pass" if good >= 36 else "fail"))
        steps[w] = [[s.new_tokens, s.kv_tokens, s.seqs, s.attn_pairs, step_time(SPEC, HW, s, slow)] for s in shapes]
    out = on_probes(search, v, cal, probes, records, steps)
    assert out["drift_on_probes"] == pytest.approx([1.3] * 4)
    assert out["attainment_error_drift_corrected"] < 0.02
    assert out["attainment_error_on_probes"] > 0.15
    assert [len(row) for row in out["probes_simulated"]] == [5] * 4
    assert "attainment_error_drift_corrected" not in on_probes(search, v, cal, probes, records)
