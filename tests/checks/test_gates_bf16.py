"""The gates in bfloat16 on SmolLM2's real weights: rounding tolerated, planted faults still rejected."""
from __future__ import annotations

import pytest

from checks.gates import GateSettings, factory_for, run_gates
from checks.quality import quality_checks
from checks.report import DEFAULT_THRESHOLDS, QualityReport
from engine import LLMEngine
from engine.config.variant import REFERENCE_VARIANT
from kernels.pointwise.activation import silu_and_mul_ref
from tests.checks.test_gates import StaleReuse, _attention_keeping, _few, _with_block_manager, _with_ops

pytestmark = pytest.mark.slow  # bf16 matmuls on a CPU without native bf16 are slow


@pytest.fixture(scope="module")
def base_bf16(smollm2_engine_factory):
    from engine import EngineConfig, resolve

    return LLMEngine(EngineConfig(source=resolve("smollm2"), dtype="bfloat16", num_kv_blocks=8, load_tokenizer=False))


@pytest.fixture(scope="module")
def short_bf16(smollm2_engine_factory):
    """SmolLM2's real weights in bf16, its first 4 of 30 layers, for the contamination scenarios (a dozen
    generations each): bf16 matmuls on a CPU without native bf16 are slow (an AVX2-only host: 73 s for this file's
    contamination test at 4 layers), and the rounding the checks must tolerate, and the stale block they must not,
    show on the real weights of a shorter stack as well. (A fault's decided flips need the whole stack: at 8
    layers the attention that drops the last partial block moves logits far, but flips too few top-1 tokens to
    fail greedy agreement.)"""
    from engine import EngineConfig, resolve

    return LLMEngine(EngineConfig(source=resolve("smollm2"), dtype="bfloat16", num_kv_blocks=8, load_tokenizer=False,
                                  layers=4))


def test_bf16_contamination_tolerates_rounding_but_not_contamination(short_bf16):
    """In bf16 the contamination checks accept tokens that flip only through rounding (logits within the
    tolerance when teacher-forced), and still reject a cache handing out a block without the request's data.
    The reference against itself agrees everywhere, with its batch noise measured."""
    clean = run_gates(factory_for(short_bf16, REFERENCE_VARIANT), factory_for(short_bf16, REFERENCE_VARIANT),
                      reference_id="reference", candidate_id="reference", dtype="bfloat16", prompts=_few(short_bf16),
                      max_tokens=6)
    print(clean.summary())
    assert clean.verdict == "pass", clean.reasons
    # the batch noise is measured (0 where the CPU's bf16 matmuls do not depend on the batch, as on an AVX2-only
    # host; positive with AVX-512 bf16 kernels)
    assert clean.greedy_agreement == 1.0 and clean.excused_ties == 0 and clean.tie_margin >= 0
    stale = run_gates(factory_for(short_bf16, REFERENCE_VARIANT), _with_block_manager(short_bf16, StaleReuse),
                      reference_id="reference", candidate_id="stale", dtype="bfloat16", prompts=_few(short_bf16),
                      max_tokens=6)
    print(stale.summary())
    assert stale.verdict == "fail" and any("prefix cache hits" in r for r in stale.reasons)


BF16_FAULTS = {
    "silu_and_mul doubled": lambda base: _with_ops(base, silu_and_mul=lambda x: silu_and_mul_ref(x) * 2),
    "attention drops the last partial block": lambda base: _with_ops(
        base, attention=_attention_keeping(lambda ctx, bs: ctx - ctx % bs or ctx)),
}


@pytest.mark.parametrize("fault", list(BF16_FAULTS))
def test_bf16_greedy_agreement_rejects_decided_flips(base_bf16, fault):
    """Ties excused at the reference's bf16 batch noise still leave a real fault's flips counted."""
    report = QualityReport(reference_variant="reference", candidate_variant="planted", dtype="bfloat16",
                           prompts=4, max_tokens=12, exact=False)
    ref = factory_for(base_bf16, REFERENCE_VARIANT)
    quality_checks(ref, BF16_FAULTS[fault](base_bf16), _few(ref(GateSettings(8, False))), 12,
                   DEFAULT_THRESHOLDS["bfloat16"], False, report)
    print(report.summary())
    assert any(r.startswith("greedy agreement") for r in report.reasons), report.reasons
    assert report.decided_positions + report.excused_ties == 4 * 12 and report.tie_margin >= 0
