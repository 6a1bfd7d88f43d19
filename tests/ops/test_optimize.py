"""The decision rule: a variant replaces static-best only when it is measurably better."""
from __future__ import annotations

import math

from engine.config.variant import VariantSpec
from ops.measure.tiers import BenchResult
from ops.search.optimize import capacity_ratio, decision_table

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
    rows[0][1].saturation = 1.25
    q = bench(0.4, 0.1, tok_s=18.0)
    q.saturation = 1.5
    text = decision_table(base, rows + [(quant, q)], base.variant_id)
    assert "weight_dtype auto -> int8" in text
    assert "  precision: static-best + int8 weights (weight_dtype int8): saturation 1.500 vs static-best 1.250 " \
           "req/s, 18.0 vs 15.5 tok/s at the traffic's rate" in text.splitlines()
