"""The quality and KV-cache contamination gates together, as plain functions over engine factories.

A factory builds an engine of one variant with the settings a check needs (pool size, prefix
caching) over weights that are already loaded. ``run_gates`` runs both gates and returns one
QualityReport; a failed check names itself and what it saw.
"""
from __future__ import annotations

import dataclasses
import time

from checks.contamination import contamination_checks
from checks.engines import EngineFactory, GateSettings, factory_for
from checks.prompts import contamination_prompts, shipped_prompts
from checks.quality import quality_checks
from checks.report import CheckResult, QualityReport, QualityThresholds, thresholds_for
from engine.core.llm_engine import LLMEngine
from engine.config.variant import VariantSpec

__all__ = ["EngineFactory", "GateSettings", "factory_for", "gate_variant", "run_gates"]


def run_gates(reference: EngineFactory, candidate: EngineFactory, *, reference_id: str, candidate_id: str,
              dtype: str, prompts: list[list[int]] | None = None, contamination: list[list[int]] | None = None,
              max_tokens: int = 12, thresholds: QualityThresholds | None = None, exact: bool = False,
              block_size: int = 16, fail_fast: bool = True, weight_dtype: str = "auto",
              kv_cache_dtype: str = "auto") -> QualityReport:
    """Quality, then contamination. With ``fail_fast`` a candidate that fails quality is not run through
    the contamination scenarios (it is rejected either way); the report says so. ``weight_dtype`` and
    ``kv_cache_dtype``: the candidate's precision, which picks the default thresholds (checks/report.py)."""
    t0 = time.perf_counter()
    probe = candidate(GateSettings(8, enable_prefix_caching=False))
    prompts = prompts or shipped_prompts(probe)
    contamination = contamination or contamination_prompts(probe, block_size)
    report = QualityReport(reference_variant=reference_id, candidate_variant=candidate_id, dtype=dtype,
                           prompts=len(prompts) + len(contamination), max_tokens=max_tokens, exact=exact,
                           weight_dtype=weight_dtype, kv_cache_dtype=kv_cache_dtype)
    t = thresholds or thresholds_for(dtype, weight_dtype, kv_cache_dtype)
    try:
        quality_checks(reference, candidate, prompts, max_tokens, t, exact, report)
        if fail_fast and not all(c.passed for c in report.quality):
            report.contamination_skipped = True
            report.seconds = time.perf_counter() - t0
            return report
        plain = weight_dtype == "auto" and kv_cache_dtype == "auto"
        tolerance = 0.0 if exact or (dtype == "float32" and plain) else t.max_rounding_kl
        contamination_checks(candidate, contamination, max_tokens, block_size, report, tolerance)
    except Exception as e:  # a candidate that crashes is a failed candidate, not a crashed gate
        report.quality.append(CheckResult("runs", False, f"{type(e).__name__}: {e}"))
    report.seconds = time.perf_counter() - t0
    return report


def gate_variant(base: LLMEngine, candidate: VariantSpec, reference: VariantSpec | None = None,
                 **kwargs) -> QualityReport:
    """The gates for a VariantSpec over ``base``'s weights, against the reference (plain-torch) variant."""
    from engine.config.variant import REFERENCE_VARIANT

    reference = reference or dataclasses.replace(REFERENCE_VARIANT, block_size=candidate.block_size)
    return run_gates(factory_for(base, reference), factory_for(base, candidate), reference_id=reference.variant_id,
                     candidate_id=candidate.variant_id, dtype=base.config.dtype, block_size=candidate.block_size,
                     weight_dtype=candidate.weight_dtype, kv_cache_dtype=candidate.kv_cache_dtype, **kwargs)
