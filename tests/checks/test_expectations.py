"""Great Expectations suites pass on real data and fail, naming the expectation, on bad data."""
from __future__ import annotations

from pathlib import Path

from checks.expectations import expect_bench_results, expect_traces
from engine.serving.trace_record import TraceRecord
from ops.measure.tiers import BenchResult
from ops.traffic.traces import load_trace

AZURE = Path(__file__).resolve().parents[2] / "traces" / "AzureLLMInferenceTrace_conv.csv"


def test_trace_expectations():
    good = load_trace(AZURE)[:200]
    assert expect_traces(good).passed
    bad = good[:5] + [TraceRecord(arrival_s=0.0, input_tokens=0, output_tokens=3)]
    out = expect_traces(bad)
    assert not out.passed
    assert any("increasing(arrival_s)" in f for f in out.failures)
    assert any("between(input_tokens)" in f for f in out.failures)


def test_bench_expectations():
    ok = BenchResult("v", "slow", 2, "t", output_tok_s=10.0, total_tok_s=20.0, spread=1.0)
    assert expect_bench_results([ok]).passed
    nan = BenchResult("v", "slow", 2, "t", output_tok_s=float("nan"), total_tok_s=1.0)
    neg = BenchResult("v", "slow", 2, "t", output_tok_s=5.0, total_tok_s=1.0, ttft_p50=-1.0)
    out = expect_bench_results([ok, nan, neg])
    assert not out.passed
    assert any("not_be_null(output_tok_s)" in f for f in out.failures)
    assert any("between(ttft_p50)" in f for f in out.failures)
