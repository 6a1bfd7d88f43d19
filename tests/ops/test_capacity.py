"""Capacity at the SLO: the rate search, its prediction by the cost model, and static-best (the sweep's choice,
its record, the engine's default)."""
from __future__ import annotations

import math
import dataclasses
import random
from pathlib import Path

import pytest

from engine import EngineConfig, LLMEngine, VariantSpec
from engine.config.source import ModelSource
from engine.serving.trace_record import TraceRecord
from ops.measure.tiers import SLO, attainment_at, own_rate, slow_tier
from ops.measure.capacity import capacity_search
from ops.predict.cost_model import predicted_capacity, simulate
from ops.measure.hardware import HardwareProfile
from ops.measure.model_spec import ModelSpec

TINY = Path(__file__).resolve().parents[1] / "engine" / "tiny_moe" / "config.json"
SPEC = ModelSpec(architecture="llama", layers=30, hidden_size=576, heads=9, kv_heads=3, head_dim=64, vocab=49152,
                 experts=0, experts_per_token=0, dtype="float32", param_bytes=4 * 134_515_008,
                 kv_bytes_per_token=2 * 30 * 3 * 64 * 4, weights_hash="x", source="x")
HW = HardwareProfile(device="test", device_count=1, memory_bytes=24 << 30, memory_bandwidth=40e9,
                     matmul_flops={"float32": 3e11}, launch_overhead_s=3e-6)


@pytest.mark.parametrize("true_capacity, guess", [(3.7, 1.0), (3.7, 40.0), (0.02, 5.0)])
def test_the_rate_search_brackets_the_capacity(true_capacity, guess):
    calls = []

    def attain(rate):
        calls.append(rate)
        return 1.0 if rate <= true_capacity else 0.5

    cap, width, probes = capacity_search(attain, guess, resolution=1.25, max_probes=20)
    assert cap <= true_capacity < cap + width and (cap + width) / cap <= 1.25
    assert [p[0] for p in probes] == calls and all((a >= 0.9) == (r <= true_capacity) for r, a in probes)


def test_a_rate_search_that_never_fails_is_a_lower_bound_and_one_that_never_passes_is_zero():
    cap, width, _ = capacity_search(lambda r: 1.0, 1.0, max_probes=4)
    assert cap == 8.0 and width == float("inf")
    cap, width, _ = capacity_search(lambda r: 0.0, 1.0, max_probes=4)
    assert cap == 0.0 and width == 0.125
    # no probe below the rate where requests stop overlapping: the search gives up there, at 0
    cap, width, probes = capacity_search(lambda r: 0.0, 1.0, max_probes=6, min_rate=0.3)
    assert cap == 0.0 and [p[0] for p in probes] == [1.0, 0.5] and width == 0.5
    cap, _, probes = capacity_search(lambda r: float(r <= 0.6), 0.1, max_probes=6, min_rate=0.3)
    assert probes[0][0] == 0.3 and 0.48 <= cap <= 0.6


def test_a_rate_search_stops_where_the_slice_arrives_at_once():
    # the slice passes at every rate: probing past the rate where it arrives at once only repeats that replay
    cap, width, probes = capacity_search(lambda r: 1.0, 1.0, max_probes=10, max_rate=5.0)
    assert [p[0] for p in probes] == [1.0, 2.0, 4.0, 5.0] and cap == 5.0 and width == float("inf")
    cap, width, probes = capacity_search(lambda r: 1.0, 50.0, max_probes=10, max_rate=5.0)
    assert [p[0] for p in probes] == [5.0] and cap == 5.0 and width == float("inf")
    # a capacity below the cap is bracketed as before
    cap, width, probes = capacity_search(lambda r: float(r <= 4.5), 1.0, max_probes=10, max_rate=5.0)
    assert 4.0 <= cap <= 4.5 < cap + width and all(p[0] <= 5.0 for p in probes)


def _records(n=24, gap=0.5, prompt=200, out=24):
    return [TraceRecord(arrival_s=i * gap, input_tokens=prompt, output_tokens=out, source="t") for i in range(n)]


def test_the_predicted_capacity_is_where_simulated_attainment_crosses_90_percent():
    recs = _records()
    sim = dict(max_output=24, slo_ttft_s=0.5, slo_tpot_s=0.05)
    cap = predicted_capacity(SPEC, HW, recs, VariantSpec(), **sim)
    rate0 = own_rate(recs)

    def attain(rate):
        return simulate(SPEC, HW, recs, VariantSpec(), time_scale=rate0 / rate, **sim).attainment

    assert cap > 0 and attain(cap) >= 0.9 and attain(cap * 1.1) < 0.9
    # a variant that runs one sequence at a time serves fewer requests under the same SLO
    assert predicted_capacity(SPEC, HW, recs, VariantSpec(max_num_seqs=1), **sim) < cap


def test_the_slow_tier_measures_capacity_with_probes_on_both_sides():
    eng = LLMEngine(EngineConfig(source=ModelSource("synthetic", TINY, seed=0), num_kv_blocks=256,
                                 load_tokenizer=False, variant=VariantSpec(block_size=4)))
    recs = _records(n=12, gap=0.2, prompt=40, out=6)
    prompts = [[1 + (i + j) % 60 for j in range(40)] for i in range(12)]
    eng.generate([prompts[0]], None)  # warm-up
    slo = SLO(ttft_s=0.05, tpot_s=0.02)
    res = slow_tier(eng, recs, prompts, "t", repeats=1, time_scale=1.0, max_output=6, slo=slo, capacity_guess=2.0)
    assert res.rate_probes and res.slo_ttft_s == 0.05
    passed = [r for r, a in res.rate_probes if a >= 0.9]
    failed = [r for r, a in res.rate_probes if a < 0.9]
    assert res.capacity == max(passed, default=0.0)
    assert all(f > res.capacity for f in failed)
    # the capacity is a rate the engine really sustains: replayed again there, it holds (within one request)
    if res.capacity > 0 and res.capacity_spread != float("inf"):
        assert attainment_at(eng, recs, prompts, res.capacity, 6, slo) >= 0.9 - 1 / len(recs) - 1e-9


def test_a_replay_skips_idle_gaps_and_times_requests_as_in_real_time():
    import time

    eng = LLMEngine(EngineConfig(source=ModelSource("synthetic", TINY, seed=0), num_kv_blocks=256,
                                 load_tokenizer=False, variant=VariantSpec(block_size=4)))
    recs = _records(n=4, gap=100.0, prompt=20, out=4)  # 300 s of arrivals, each request alone
    prompts = [[1 + (i + j) % 60 for j in range(20)] for i in range(4)]
    eng.generate([prompts[0]], None)  # warm-up
    t0 = time.perf_counter()
    res = slow_tier(eng, recs, prompts, "t", repeats=1, time_scale=1.0, max_output=4, slo=SLO(ttft_s=5, tpot_s=5))
    assert time.perf_counter() - t0 < 60  # the idle gaps were skipped, not slept
    assert res.attainment == 1.0 and 0 < res.ttft_p99 < 5 and res.e2e_p99 < 5  # latencies: busy time only
    # throughput is over the trace's span (idle time included), as a real-time replay would measure it
    assert res.output_tok_s == pytest.approx(16 / 300, rel=0.05)


def test_static_best_is_the_sweeps_best_recorded_and_the_engines_default(tmp_path, monkeypatch):
    from engine.config import static_best
    from ops.measure.static_best_sweep import Workload, sweep

    monkeypatch.setenv("POLYINF_STATIC_BEST", str(tmp_path / "static_best.json"))
    source = ModelSource("synthetic", TINY, seed=0)
    one_at_a_time = VariantSpec(name="one at a time", max_num_seqs=1)
    batched = VariantSpec(name="batched", max_num_seqs=16, max_num_batched_tokens=256)
    best, record = sweep(source, workload=Workload(prompt=24, output=6, requests=12, rate=4.0),
                         variants=[one_at_a_time, batched], num_kv_blocks=256, slo=SLO(0.3, 0.05), log=lambda m: None)
    rows = {r["name"]: r for r in record["rows"]}
    assert set(rows) == {"one at a time", "batched"} and record["slo"] == {"ttft_s": 0.3, "tpot_s": 0.05}
    winner = max(record["rows"], key=lambda r: r["capacity"])
    assert best.variant_id == winner["variant_id"] and best.name == "static-best"
    assert static_best.lookup(source, "cpu", "float32") is None
    static_best.record(source, "cpu", "float32", best, record)
    assert static_best.lookup(source, "cpu", "float32") == dataclasses.replace(best, name="static-best")
    assert static_best.lookup(source, "cpu", "bfloat16") is None  # per dtype
    eng = LLMEngine(EngineConfig(source=source, num_kv_blocks=64, load_tokenizer=False))
    assert eng.variant.variant_id == best.variant_id  # the engine starts from it without being told


def test_unloaded_latency_samples_the_slice_across_its_prompt_lengths():
    """The SLO's unloaded requests span the slice's lengths, its longest prompt among them: an SLO derived from
    the first few prompts of a long-context slice failed its long prompts even when they ran alone."""
    from ops.measure.static_best_sweep import spread_by_length

    rng = random.Random(7)
    prompts = [[1] * rng.randrange(1, 5000) for _ in range(24)]
    picked = spread_by_length(prompts, 4)
    lengths = sorted(len(p) for p in prompts)
    assert len(picked) == 4 and len({id(p) for p in picked}) == 4
    assert [len(p) for p in picked] == sorted(len(p) for p in picked)
    assert len(picked[-1]) == lengths[-1]
    assert len(picked[0]) <= lengths[len(lengths) // 2]  # the short half is represented
    assert spread_by_length(prompts[:3], 4) == sorted(prompts[:3], key=len)


def test_a_derived_slo_grows_with_the_prompt_and_ignores_one_slowed_request():
    from ops.measure.static_best_sweep import TPOT_FACTOR, TTFT_FACTOR, derive_slo

    rng = random.Random(5)
    a, b = 0.02, 0.0004  # unloaded TTFT = a + b x tokens, with a few percent of noise
    pts = [(n, (a + b * n) * rng.uniform(0.97, 1.03), 0.05 * rng.uniform(0.97, 1.03)) for n in (40, 300, 900, 1700, 2048, 120)]
    slo = derive_slo(pts)
    assert abs(slo.ttft_per_token_s / TTFT_FACTOR - b) < 0.1 * b
    assert abs(slo.ttft_limit(1000) / TTFT_FACTOR - (a + b * 1000)) < 0.05 * (a + b * 1000)
    assert all(slo.ttft_limit(n) >= t for n, t, _ in pts)  # every request meets its target alone
    assert 0.95 * TPOT_FACTOR * 0.05 < slo.tpot_s < 1.05 * TPOT_FACTOR * 0.05
    # one request slowed 40% by contention leaves the target where it was; a far slower one raises it
    slowed = derive_slo(pts[:-1] + [(120, 1.4 * (a + b * 120), 0.05)])
    assert abs(slowed.ttft_limit(1000) - slo.ttft_limit(1000)) < 0.05 * slo.ttft_limit(1000)
    flat = derive_slo([(64, t, 0.06) for t in (0.15, 0.14, 0.15, 0.16, 0.15, 1.5)])
    assert flat.ttft_per_token_s == 0 and flat.ttft_limit(64) >= 1.5 and flat.ttft_limit(64) < 1.6
    assert 0.7 < derive_slo([(64, t, 0.06) for t in (0.15, 0.14, 0.15, 0.16, 0.15, 0.2)]).ttft_s < 0.8


def test_a_convex_ttft_curve_gets_no_negative_intercept():
    """A GPU's prefill: flat for the shortest prompts, then linear, so the measured points lie on a line that
    crosses zero at a positive length (an H100 run derived "TTFT <= -8 ms + 0.355 ms per token"). The SLO's line
    goes through 0 instead, and every measured request keeps the factor's headroom."""
    from ops.measure.static_best_sweep import TTFT_FACTOR, derive_slo

    rng = random.Random(11)
    pts = [(n, max(0.004, 7e-5 * (n - 30)) * rng.uniform(0.99, 1.01), 0.02) for n in (60, 250, 700, 1200, 1700, 2048)]
    slo = derive_slo(pts)
    assert slo.ttft_s == 0 and slo.ttft_limit(1) > 0
    assert all(slo.ttft_limit(n) >= TTFT_FACTOR * t * 0.999 for n, t, _ in pts)
    assert slo.ttft_limit(2048) < 1.1 * TTFT_FACTOR * max(t for _, t, _ in pts)  # and no looser than it needs


def test_a_gpu_without_its_own_static_best_takes_another_gpus_named_so(tmp_path, monkeypatch):
    from engine.config import static_best

    monkeypatch.setenv("POLYINF_STATIC_BEST", str(tmp_path / "static_best.json"))
    source = ModelSource("synthetic", TINY, seed=0)
    h200 = VariantSpec(max_num_seqs=64, cuda_graph_batch_sizes=(1, 2, 4))
    labels = {"cuda:0": "NVIDIA H200"}
    monkeypatch.setattr(static_best, "device_label", lambda d: labels.get(str(d), str(d)))
    static_best.record(source, "cuda:0", "bfloat16", h200, {"rows": []})
    assert static_best.lookup(source, "cuda:0", "bfloat16").name == "static-best"
    labels["cuda:0"] = "NVIDIA H100 80GB HBM3"  # another machine, no sweep of its own
    found = static_best.lookup(source, "cuda:0", "bfloat16")
    assert found.name == "static-best (recorded on NVIDIA H200)" and found.variant_id == h200.variant_id
    assert static_best.lookup(source, "cuda:0", "float16") is None  # the dtype still has to match
    assert static_best.lookup(source, "cpu", "bfloat16") is None  # a CPU never takes a GPU's


def test_the_search_capacity_is_interpolated_where_the_attainment_crosses_the_target():
    """The simulator's capacity: between the highest passing rate and the lowest failing one above it, where
    attainment (linear in log rate) crosses 0.90, as the judge's fitted curve places a measured capacity; the
    highest passing rate alone sits up to a bracket below it."""
    from ops.measure.capacity import search_crossing

    probes = [[1.0, 1.0], [4.0, 0.5], [2.0, 1.0], [3.0, 0.8]]
    assert search_crossing(probes) == pytest.approx(2.0 * 1.5 ** 0.5)
    assert search_crossing([[1.0, 0.5], [0.5, 0.7]]) == 0.0  # nothing passed
    assert search_crossing([[1.0, 1.0], [2.0, 0.95]]) == 2.0  # nothing failed above: a bound
    # on a fresh linear-in-log curve the interpolation is exact, the bracket's low end is not
    true = 3.7
    attain = lambda r: min(1.0, max(0.0, 0.9 - 0.4 * math.log(r / true)))  # noqa: E731
    _, _, found = capacity_search(attain, 1.0, resolution=1.25, max_probes=20)
    assert search_crossing(found) == pytest.approx(true, rel=1e-9)
    assert capacity_search(attain, 1.0, resolution=1.25, max_probes=20)[0] < 0.97 * true


def test_the_gpu_sweep_has_static_forms_with_prefill_graphs():
    """The tuner's precision candidate replays its prefill steps as graphs; static-best's sweep offers the same
    graphs in bf16, so a precision's measured gain cannot be the graphs'. CPU forms have none (no CUDA graphs)."""
    from ops.measure.static_best_sweep import candidates

    gpu = candidates("cuda", 4096)
    assert len({v.variant_id for v in gpu}) == len(gpu)  # no form the sweep would measure twice
    graphed = [v for v in gpu if v.prefill_graph_tokens]
    assert {v.name for v in graphed} == {"triton-paged, prefill graphs", "triton-paged, prefill graphs, pdl 1",
                                         "dense-decode, prefill graphs"}
    for v in graphed:
        assert v.max_num_seqs == 32 and v.prefill_chunk_size == v.max_num_batched_tokens == 2048
        assert v.prefill_graph_tokens == (128, 256, 512, 1024, 2048) and v.cuda_graph_batch_sizes
        plain = next(p for p in gpu if p.name == v.name.split(",")[0] and p.max_num_seqs == 32
                     and p.prefill_chunk_size is None)
        assert v.changes_from(plain)  # a form of its own, not a duplicate the sweep would measure twice
    # the triton-paged forms at 32 sequences with dependent launch too (the one-byte forms launch so): the same
    # form otherwise, every kernel that takes it at level 1
    from engine.config.presets import PDL_OPS
    launched = [v for v in gpu if v.name.endswith(", pdl 1")]
    assert len(launched) == 3 and all(v.name.startswith("triton-paged") and v.max_num_seqs == 32 for v in launched)
    for v in launched:
        twin = next(p for p in gpu if p.name == v.name[:-len(", pdl 1")] and p.prefill_chunk_size == v.prefill_chunk_size)
        assert dataclasses.replace(v, name=twin.name, kernel_params=twin.kernel_params) == twin
        assert all(dict(dict(v.kernel_params)[op])["pdl"] == 1 for op in PDL_OPS)
    assert not any(v.prefill_graph_tokens for v in candidates("cpu", 576))
    assert not any(v.prefill_graph_tokens for v in candidates("cuda", 2048, moe=True))  # the engine captures none
