"""Data expectations (Great Expectations 1.x) on traces and benchmark results.

GX is imported inside the functions: importing it takes seconds.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpectationOutcome:
    passed: bool
    evaluated: int
    failures: list[str]  # one line per failed expectation


def _validate(rows: list[dict], name: str, expectations: list) -> ExpectationOutcome:
    import os

    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")  # no network calls
    import great_expectations as gx
    import pandas as pd

    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False, metric_calculations=False)
    source = context.data_sources.add_pandas(name)
    batch_def = source.add_dataframe_asset(name).add_batch_definition_whole_dataframe(name)
    batch = batch_def.get_batch(batch_parameters={"dataframe": pd.DataFrame(rows)})
    suite = context.suites.add(gx.ExpectationSuite(name=name))
    for e in expectations:
        suite.add_expectation(e)
    result = batch.validate(suite)
    failures = []
    for r in result.results:
        if not r.success:
            cfg = r.expectation_config
            col = cfg.kwargs.get("column", "")
            unexpected = (r.result or {}).get("partial_unexpected_list") or (r.result or {}).get("observed_value")
            failures.append(f"{cfg.type}({col}): unexpected {str(unexpected)[:80]}")
    return ExpectationOutcome(passed=result.success, evaluated=len(result.results), failures=failures)


def expect_traces(records) -> ExpectationOutcome:
    """Schema, ranges and no missing values on TraceRecords."""
    import great_expectations as gx

    E = gx.expectations
    rows = [{"arrival_s": r.arrival_s, "input_tokens": r.input_tokens, "output_tokens": r.output_tokens}
            for r in records]
    if not rows:
        return ExpectationOutcome(False, 0, ["the trace has no requests"])
    checks = [E.ExpectTableColumnsToMatchSet(column_set=["arrival_s", "input_tokens", "output_tokens"])]
    for col in ("arrival_s", "input_tokens", "output_tokens"):
        checks.append(E.ExpectColumnValuesToNotBeNull(column=col))
    checks += [
        E.ExpectColumnValuesToBeBetween(column="arrival_s", min_value=0),
        E.ExpectColumnValuesToBeIncreasing(column="arrival_s", strictly=False),
        E.ExpectColumnValuesToBeBetween(column="input_tokens", min_value=1, max_value=2_000_000),
        E.ExpectColumnValuesToBeBetween(column="output_tokens", min_value=0, max_value=1_000_000),
    ]
    return _validate(rows, "traces", checks)


def expect_bench_results(results) -> ExpectationOutcome:
    """Every BenchResult complete, finite and in range."""
    import math

    import great_expectations as gx

    E = gx.expectations
    cols = ["output_tok_s", "total_tok_s", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "spread", "goodput"]
    rows = [{c: (float("nan") if not math.isfinite(getattr(r, c)) else getattr(r, c)) for c in cols}
            for r in results]
    if not rows:
        return ExpectationOutcome(False, 0, ["no benchmark results"])
    checks = []
    for c in cols:
        checks.append(E.ExpectColumnValuesToNotBeNull(column=c))
        checks.append(E.ExpectColumnValuesToBeBetween(column=c, min_value=0))
    checks.append(E.ExpectColumnValuesToBeBetween(column="output_tok_s", min_value=0, strict_min=True))
    return _validate(rows, "bench_results", checks)
