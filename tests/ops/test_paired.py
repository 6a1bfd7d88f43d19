"""The judge's lockstep replays on a real engine (a tiny synthetic Llama on the CPU): the simulator's capacity,
calibrated on the slow tier's own steps, against the capacity the replays measure; and each arm of a round
getting its share of a short budget."""
from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import pytest

from engine.config.variant import VariantSpec
from ops.measure.tiers import _replay, own_rate
from ops.measure.capacity import capacity_search, search_crossing
from ops.predict.cost_model import predicted_capacity
from ops.measure.hardware import probe
from ops.judge.paired import ArmRun, JudgeConfig, PairedJudge
from ops.traffic.traces import Windows
from ops.search.config import SLOW, SearchConfig, static_best_of
from ops.search.worker import Workbench, calibration_from

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "traces" / "AzureLLMInferenceTrace_conv.csv"


@pytest.fixture
def bench(tmp_path):
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 512}))
    cfg = SearchConfig(model=str(model / "config.json"), trace=str(TRACE), requests=16, max_input=48, max_output=8,
                       time_scale=1.0, num_kv_blocks=256, slow_repeats=1,
                       # targets far above the scheduler's jitter on a loaded machine (a tiny model's unloaded
                       # latency is a few ms): the capacity is where queues build, near saturation
                       slo_ttft_s=0.06, slo_tpot_s=0.015)
    wb = Workbench(cfg, probe("cpu", size_mb=16))
    wb.with_slo()
    return wb


def _judge(wb: Workbench, max_output: int | None = None, **kw) -> PairedJudge:
    jcfg = JudgeConfig.for_cpu(**{"first_look": 20, "cap": 40, "saturation_rounds": 1, **kw})
    return PairedJudge(lambda v: wb.engine(SLOW, v), wb.prompts_for, Windows(wb.stream, skip=len(wb.records)),
                       wb.cfg.slo, max_output or wb.cfg.max_output, jcfg)


def test_the_simulators_capacity_against_the_replays(bench, monkeypatch):
    """The real engine (its scheduler, block manager and batching) replayed on a virtual clock that advances by
    a known step-time law, so that the comparison is exact to repeat and no load on the machine moves it: the
    simulator, calibrated on the replays' own steps, predicts the capacity the replays measure on the same
    requests with the same rate search."""
    base = static_best_of(bench.cfg)
    eng = bench.engine(SLOW, base)
    clock = [1000.0]
    ran: dict = {}
    real_step = eng.step

    def step():
        outs = real_step()
        new = 0
        for o in outs:
            now = o.num_cached_tokens + o.num_tokens_run
            new += max(0, now - ran.get(o.request_id, o.num_cached_tokens))
            ran[o.request_id] = now
        clock[0] += 0.004 + 0.001 * len(outs) + 0.00004 * new  # launch, per sequence, per token
        return outs
    recs = bench.stream[:64]
    prompts = bench.prompts_for(recs, 0)
    cfg = bench.cfg
    samples: list = []

    def attain(rate: float) -> float:
        eng.block_manager.reset_prefix_cache()  # as every probe does: the simulation starts from an empty cache
        r = _replay(eng, recs, prompts, cfg.max_output, own_rate(recs) / rate, cfg.slo)
        samples.extend(r["samples"])
        return r["good"] / len(recs)
    monkeypatch.setattr(eng, "step", step)
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    _, _, probes = capacity_search(attain, own_rate(recs), resolution=1.05, max_probes=14)
    measured = search_crossing(probes)  # interpolated, as the judge's fitted curve is
    monkeypatch.undo()
    assert measured > 0 and any(a < 0.9 for _, a in probes), probes  # a capacity, not a bound
    cal = calibration_from(bench.spec_for(SLOW), bench.hardware, samples)
    assert cal is not None and cal.fit_mape < 0.05  # the law is learned from the steps
    predicted = predicted_capacity(bench.spec_for(SLOW), bench.hardware, recs, base, cal, **cfg.sim)
    # the simulator drives the engine's own scheduler and block manager: with the step law learned, it predicts
    # the replays' capacity within the judge's 10% target (here within 3%; it was 16% low while these replays
    # kept the previous probe's prefix cache, which the simulation never has). Real GPUs' errors (15-26% on
    # 2026-12-06) come from step times the calibration's law does not capture, not from the scheduling
    assert 1 / 1.03 < predicted / measured < 1.03, (predicted, measured, probes)
    # a judge's probe (a warm-up, then counted requests, stopped once decided) and the simulator replaying the
    # same window at the same rate, counting the same requests: the same attainment, request for request
    from ops.measure.tiers import probe as rate_probe
    from ops.predict.cost_model import simulate

    window = bench.stream[64:124]
    monkeypatch.setattr(eng, "step", step)
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    for rate in (0.9 * measured, 1.3 * measured):
        p, _ = rate_probe(eng, window, bench.prompts_for(window, 64), rate, cfg.slo, 4, [40], cfg.max_output)
        assert p.replayed == len(window) and 0 < p.n <= 40  # stopped once decided
        sim = {k: x for k, x in cfg.sim.items() if k != "time_scale"}
        got = simulate(bench.spec_for(SLOW), bench.hardware, window, base, cal, time_scale=own_rate(window) / rate,
                       counted=(4, 4 + p.n), **sim).attainment
        assert abs(got - p.attainment) <= 2 / p.n, (rate, got, p.attainment)
    monkeypatch.undo()


def test_each_arm_of_a_round_gets_its_share_of_a_short_budget(monkeypatch):
    """Probes that would run past any budget (each one runs to the deadline it is given, on a virtual clock):
    the first arm of a round may not spend the second one's share, and a round whose first looks cannot fit in
    what is left is not started."""
    import ops.judge.paired as paired
    from ops.measure.tiers import SLO
    from ops.measure.capacity import Probe
    from ops.traffic.traces import load_trace

    clock = [100.0]
    given: list = []

    def endless_probe(engine, records, prompts, rate, slo, warmup, plan, max_output, window=0, deadline=None):
        given.append((rate, deadline - clock[0]))
        clock[0] = deadline  # it ran until it was stopped, counting a few requests
        return Probe(rate=rate, outcomes=[1] * 5, warmup=warmup, window=window, verdict="undecided"), \
            [[1, 8, 1, 8, 0.01]] * len(given)  # the first probe 1 step, the second 2

    class Engine:
        def generate(self, *a, **k):
            return []
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(paired, "probe", endless_probe)
    base = VariantSpec(name="static-best")
    other = dataclasses.replace(base, name="other", max_num_seqs=2)
    arms = [ArmRun(base, saturation=3.0), ArmRun(other, saturation=3.0)]
    pj = PairedJudge(lambda v: Engine(), lambda recs, seed: [[1] * 8 for _ in recs], Windows(load_trace(str(TRACE))),
                     SLO(ttft_s=0.5, tpot_s=0.1), 8, JudgeConfig.for_cpu(first_look=20, cap=60))
    pj.deadline = clock[0] + 40
    caps = pj.search(arms)
    assert [round(d, 6) for _, d in given] == [20.0, 20.0]  # half each, not all of it to the first
    for a in arms:
        assert caps[a.variant.variant_id].requests == 5
    assert clock[0] == pj.deadline  # and no round started with nothing left
    window = caps[base.variant_id].probes[0].window  # each arm's steps of the probe, found by its window
    assert [a.spans for a in arms] == [{window: (0, 1)}, {window: (0, 2)}]


def test_a_prediction_too_slow_for_the_budget_is_probed_at_the_slowest_affordable_rate(monkeypatch):
    """A prediction far below what the budget can probe (a first look at it would outlast the budget): the search
    starts at the slowest rate whose first looks fit, and an arm failing there is censored below that rate,
    not left unmeasured; with time left after that round, the censored arms go on lower (one first look each
    in the time left), still within the budget, and are censored below the lowest rate they failed."""
    import ops.judge.paired as paired
    from ops.measure.tiers import SLO
    from ops.measure.capacity import Probe
    from ops.traffic.traces import load_trace

    clock = [100.0]
    rates: list = []

    def failing_probe(engine, records, prompts, rate, slo, warmup, plan, max_output, window=0, deadline=None):
        rates.append(rate)  # failing every request, it stops half-way through its first look (futility)
        n = plan[0] // 2
        clock[0] += (warmup + n) / rate  # not held at the deadline: a round the budget cannot hold must not start
        return Probe(rate=rate, outcomes=[0] * n, warmup=warmup, window=window, verdict="fail"), []

    class Engine:
        def generate(self, *a, **k):
            return []
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(paired, "probe", failing_probe)
    base = VariantSpec(name="static-best")
    other = dataclasses.replace(base, name="other", max_num_seqs=2 * base.max_num_seqs)
    arms = [ArmRun(base, saturation=30.0, predicted=0.05), ArmRun(other, saturation=30.0, predicted=0.08)]
    pj = PairedJudge(lambda v: Engine(), lambda recs, seed: [[1] * 8 for _ in recs], Windows(load_trace(str(TRACE))),
                     SLO(ttft_s=0.5, tpot_s=0.1), 8, JudgeConfig.for_cpu(first_look=20, cap=60))
    pj.deadline = clock[0] + 40
    caps = pj.search(arms)
    affordable = 2 * 2 * (20 + 2) / 40
    assert rates[:2] == [pytest.approx(affordable)] * 2  # both start at the slowest rate the budget affords
    assert min(rates) < affordable / 1.05 and clock[0] <= pj.deadline  # then lower, within the budget
    for a in arms:
        cap = caps[a.variant.variant_id]
        assert cap.requests >= 20 and cap.censored == "below" and len(cap.probes) >= 2
        assert cap.estimate == pytest.approx(min(p.rate for p in cap.probes))


def test_the_judgement_says_whether_each_prediction_falls_inside_its_measured_interval(monkeypatch):
    """The simulator's point error beside the fairer test on a host whose measured capacity is wide: whether
    each arm's predicted capacity lies inside that arm's measured 95% interval (censored and unmeasured arms left
    out)."""
    from ops.judge.paired import run_judgement
    from ops.measure.capacity import Capacity
    from ops.measure.tiers import SLO
    from ops.traffic.traces import load_trace

    base = VariantSpec(name="static-best")
    other = dataclasses.replace(base, name="other", max_num_seqs=2 * base.max_num_seqs)
    third = dataclasses.replace(base, name="third", max_num_seqs=3 * base.max_num_seqs)
    arms = [ArmRun(base, saturation=5.0, predicted=2.5), ArmRun(other, saturation=5.0, predicted=4.0),
            ArmRun(third, saturation=5.0, predicted=1.0)]
    measured = {base.variant_id: Capacity(2.0, 1.5, 2.8), other.variant_id: Capacity(2.2, 1.9, 2.6),
                third.variant_id: Capacity(0.5, 0.0, 0.5, censored="below")}
    pj = PairedJudge(lambda v: None, lambda recs, seed: [], Windows(load_trace(str(TRACE))),
                     SLO(ttft_s=0.5, tpot_s=0.1), 8, JudgeConfig.for_cpu(first_look=20, cap=60))
    monkeypatch.setattr(pj, "measure_saturation", lambda a: 0)
    monkeypatch.setattr(pj, "search", lambda a, err=None: measured)
    j, _ = run_judgement(pj, arms[0], arms[1:], {})
    assert j.kept and j.simulator_error == pytest.approx(max(0.5 / 2.0, 1.8 / 2.2))
    assert "the simulator's capacity falls inside the measured 95% interval for 1 of 2 arms" in j.notes
    # arms the budget never reached (no estimate, no bound) are neither inside nor outside: no note, no error
    measured = {v.variant_id: Capacity(0.0, 0.0, math.inf, status="unmeasured") for v in (base, other, third)}
    j, _ = run_judgement(pj, arms[0], arms[1:], {})
    assert math.isnan(j.simulator_error) and not any("inside the measured" in n for n in j.notes)


def test_with_nothing_chosen_the_searches_go_on_into_half_the_confirmations_share(monkeypatch):
    """Two arms alike (every request meets the SLO below 3 req/s, none above) whose searches the budget ends
    before they converge: nothing is chosen, so no confirmation will spend its share, and half of it carries the
    searches on; the whole judgement still ends within its budget."""
    import ops.judge.paired as paired
    from ops.judge.paired import run_judgement
    from ops.measure.tiers import SLO
    from ops.measure.capacity import Probe
    from ops.traffic.traces import load_trace

    clock = [100.0]
    started: list = []

    def probe_at(engine, records, prompts, rate, slo, warmup, plan, max_output, window=0, deadline=None):
        started.append(clock[0])
        clock[0] += (warmup + plan[0]) / rate
        ok = rate < 3.0
        return Probe(rate=rate, outcomes=[int(ok)] * plan[0], warmup=warmup, window=window,
                     verdict="pass" if ok else "fail"), []

    class Engine:
        def generate(self, *a, **k):
            return []
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(paired, "probe", probe_at)
    base = VariantSpec(name="static-best")
    other = dataclasses.replace(base, name="other", max_num_seqs=2 * base.max_num_seqs)
    arms = [ArmRun(base, saturation=2.0), ArmRun(other, saturation=2.0)]
    cfg = JudgeConfig.for_cpu(first_look=20, cap=60, seconds=100.0, resolution=1.02, max_probes=20)
    pj = PairedJudge(lambda v: Engine(), lambda recs, seed: [[1] * 8 for _ in recs], Windows(load_trace(str(TRACE))),
                     SLO(ttft_s=0.5, tpot_s=0.1), 8, cfg)
    monkeypatch.setattr(pj, "measure_saturation", lambda a: 0)
    j, caps = run_judgement(pj, arms[0], arms[1:], {})
    searched_until = 100.0 + cfg.seconds * (1 - cfg.confirm_share)
    assert j.kept and j.confirmation is None and j.verdict in ("censored", "no detectable difference")
    assert any(t >= searched_until for t in started)  # probes past the searches' own deadline
    assert clock[0] <= 100.0 + cfg.seconds * (1 - cfg.confirm_share / 2)  # half the share left unspent
    assert sum(len(c.probes) for c in caps.values()) == len(started)
    assert all(2.0 <= c.estimate < 3.0 for c in caps.values())
