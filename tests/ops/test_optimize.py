"""The decision rule: a variant replaces static-best only when it is measurably better."""
from __future__ import annotations

import math

from engine.variant import VariantSpec
from ops.bench import BenchResult
from ops.optimize import capacity_line, capacity_ratio, choose, decision_table, range_holds_one

BASE = VariantSpec(name="static-best")
CAND = VariantSpec(name="candidate", max_num_seqs=16)


def bench(capacity: float, bracket: float, tok_s: float = 100.0, spread: float = 0.0, repeats: int = 2,
          attainment: float = 1.0) -> BenchResult:
    return BenchResult(variant_id="x", tier="slow", layers=1, trace_id="t", output_tok_s=tok_s, total_tok_s=tok_s,
                       repeats=repeats, spread=spread, capacity=capacity, capacity_spread=bracket,
                       attainment=attainment, slo_ttft_s=0.5, slo_tpot_s=0.02)


def test_the_ratio_range_comes_from_both_brackets():
    ratio, low, high = capacity_ratio(bench(14.775, 2.796), bench(10.448, 1.977))
    assert math.isclose(ratio, 14.775 / 10.448)
    assert math.isclose(low, 14.775 / (10.448 + 1.977)) and math.isclose(high, (14.775 + 2.796) / 10.448)
    assert all(math.isnan(x) for x in capacity_ratio(bench(1.0, 0.5), bench(0.0, 0.3)))
    line = capacity_line(bench(14.775, 2.796), bench(10.448, 1.977))
    assert line.startswith("capacity at SLO, chosen / static-best: 1.41x (range 1.19-1.68x")
    assert "TTFT <= 500 ms and TPOT <= 20 ms" in line


def test_a_candidate_that_passed_where_static_best_failed_replaces_it():
    c = choose([(CAND, bench(14.775, 2.796))], (BASE, bench(10.448, 1.977)))
    assert c.variant == CAND and "brackets 14.78-17.57 and 10.45-12.43" in c.reason
    # static-best failed at every rate it tried (0.3 req/s the lowest); the candidate passed 0.4
    assert choose([(CAND, bench(0.4, 0.1))], (BASE, bench(0.0, 0.3))).variant == CAND
    assert choose([(CAND, bench(0.2, 0.1))], (BASE, bench(0.0, 0.3))).variant == BASE
    # the candidate passed the very rate static-best failed (one replay each, so throughput could not decide)
    passed, failed = 0.475, 0.475 * 2 ** 0.5
    c = choose([(CAND, bench(failed, 0.278, repeats=1))], (BASE, bench(passed, failed - passed, repeats=1)))
    assert c.variant == CAND
    assert not range_holds_one(*capacity_ratio(bench(failed, 0.278), bench(passed, failed - passed))[1:])
    assert range_holds_one(*capacity_ratio(bench(failed * 0.99, 0.278), bench(passed, failed - passed))[1:])


def test_overlapping_brackets_keep_static_best_unless_throughput_is_higher_beyond_both_spreads():
    base = bench(10.0, 2.0, tok_s=100.0, spread=1.0)
    assert choose([(CAND, bench(11.0, 2.0, tok_s=101.5, spread=1.0))], (BASE, base)).variant == BASE
    assert choose([(CAND, bench(11.0, 2.0, tok_s=103.0, spread=1.0))], (BASE, base)).variant == CAND
    # a single replay has no spread: its throughput cannot win
    one = bench(10.0, 2.0, tok_s=100.0, repeats=1)
    kept = choose([(CAND, bench(10.0, 2.0, tok_s=100.1, repeats=1))], (BASE, one))
    assert kept.variant == BASE and "not measurably better" in kept.reason
    # nor can a lower SLO attainment at the traffic's own rate
    assert choose([(CAND, bench(11.0, 2.0, tok_s=110.0, spread=1.0, attainment=0.8))], (BASE, base)).variant == BASE


def test_static_best_measured_best_is_kept_and_a_lower_bound_does_not_win():
    assert choose([(CAND, bench(5.0, 1.0))], (BASE, bench(10.0, 2.0))).reason.startswith("static-best measured best")
    # static-best never failed (a lower bound): nobody passed a rate it failed
    assert choose([(CAND, bench(20.0, 4.0))], (BASE, bench(10.0, math.inf))).variant == BASE


def test_the_decision_table_says_what_differs_and_marks_the_choice():
    base = VariantSpec(name="static-best", max_num_seqs=8)
    knob = VariantSpec(name="fewer seqs", max_num_seqs=4, block_size=32)
    kern = VariantSpec(name="triton norm", max_num_seqs=8, kernels=(("rms_norm", "triton"),))
    assert knob.changes_from(base) == "max_num_seqs 8 -> 4; block_size 16 -> 32"
    assert kern.changes_from(base) == "rms_norm reference -> triton" and base.changes_from(base) == "none"
    fast = bench(0.0, 0.0, tok_s=80.0)
    fast.tier = "fast"
    rows = [(base, bench(0.28, 0.12, tok_s=15.5)), (knob, bench(0.5, 0.1, tok_s=12.0)), (kern, fast)]
    text = decision_table(base, rows, knob.variant_id, "pass").splitlines()
    assert text[2].startswith("  static-best") and " none " in text[2] and text[2].endswith("  -")
    assert text[3].startswith("* fewer seqs") and "0.500 (+0.100)" in text[3] and text[3].endswith("  pass")
    assert text[4].startswith("  triton norm") and " fast " in text[4] and " 80.0 " in text[4]
    # precision on a line of its own, against static-best
    quant = VariantSpec(name="static-best + int8 weights", max_num_seqs=8, weight_dtype="int8")
    text = decision_table(base, rows + [(quant, bench(0.4, 0.1, tok_s=18.0))], base.variant_id)
    assert "weight_dtype auto -> int8" in text
    assert "  precision: static-best + int8 weights (weight_dtype int8): capacity 0.400 vs static-best 0.280 " \
           "req/s, 18.0 vs 15.5 tok/s" in text.splitlines()
