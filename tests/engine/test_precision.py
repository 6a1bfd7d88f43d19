"""Weight precision as a variant: SmolLM2 with int8 weights answers like the checkpoint, the quantized copies
are made once, a swap to int8 and a rollback leave the checkpoint's weights untouched, and the gates judge a
precision by its own thresholds."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import SamplingParams, VariantSpec
from engine.errors import ConfigError, VariantError
from engine.precision import dense_weights, quantized_bytes, quantized_weights

FRANCE = "What is the capital of France?"


def _checksum(model) -> list[tuple[int, float]]:
    return [(w.data_ptr(), float(w.double().sum())) for w in dense_weights(model)]


def test_int8_weights_answer_like_the_checkpoint(smollm2_engine_factory):
    eng = smollm2_engine_factory(num_kv_blocks=32, variant=VariantSpec(weight_dtype="int8"))
    out = eng.generate([FRANCE], SamplingParams(max_tokens=16), chat=True)[0]
    assert out.text == "The capital of France is Paris."
    table = quantized_weights(eng.model, "int8")
    assert quantized_weights(eng.model, "int8") is table  # quantized once per model, then cached
    # every dense projection, and the tied lm_head (the embedding table) once
    assert len(table) == 4 * eng.model_config.num_hidden_layers + 1
    assert all(q.q.dtype == torch.int8 for q in table.values())
    full = sum(w.numel() * w.element_size() for w in dense_weights(eng.model))
    assert quantized_bytes(eng.model, "int8") < full / 3.9  # one byte per float32 weight, plus the scales


def test_swap_to_int8_and_rollback_keep_the_checkpoint(smollm2_engine_factory):
    eng = smollm2_engine_factory(num_kv_blocks=32)
    before = _checksum(eng.model)
    params = SamplingParams(max_tokens=8)
    plain = eng.generate([FRANCE], params, chat=True)[0].token_ids
    report = eng.swap_variant(dataclasses.replace(eng.variant, weight_dtype="int8"))
    assert report.scopes == ["forward"]  # weights stay loaded: the quantized copies are added beside them
    assert eng.variant.weight_dtype == "int8"
    assert eng.generate([FRANCE], params, chat=True)[0].token_ids[:6] == plain[:6]
    eng.rollback()
    assert eng.variant.weight_dtype == "auto"
    assert _checksum(eng.model) == before  # nothing reloaded, nothing written
    assert eng.generate([FRANCE], params, chat=True)[0].token_ids == plain


def test_precision_field_is_validated_and_ids_are_stable():
    with pytest.raises(ConfigError, match="weight_dtype must be one of auto, int8, fp8"):
        VariantSpec(weight_dtype="int4")
    spec = VariantSpec(weight_dtype="fp8")
    assert VariantSpec.from_json(spec.to_json()) == spec and spec.variant_id != VariantSpec().variant_id
    assert "weight_dtype auto -> fp8" in spec.changes_from(VariantSpec())
    assert VariantSpec.change_schema()["weight_dtype"] == {"enum": ["auto", "int8", "fp8"]}


def test_generated_linear_kernels_refuse_quantized_weights(smollm2_engine_factory):
    eng = smollm2_engine_factory(num_kv_blocks=8)
    # refused before the generated source is even checked: it takes the checkpoint's weights only
    spec = dataclasses.replace(eng.variant, weight_dtype="int8", kernels={"act_linear": "generated:gen.act_linear"},
                               generated_source={"gen": "def act_linear(x, weight):\n    return x\n"})
    before = eng.variant
    with pytest.raises(VariantError, match="cannot run generated kernels for act_linear"):
        eng.swap_variant(spec)
    assert eng.variant == before


def test_gates_judge_a_precision_by_its_own_thresholds(smollm2_engine_factory):
    from checks.gates import gate_variant

    base = smollm2_engine_factory(num_kv_blocks=8)
    prompts = [base.encode_prompt(FRANCE, chat=True), base.encode_prompt("Name three colors.", chat=True)]
    report = gate_variant(base, VariantSpec(weight_dtype="int8"), prompts=prompts, max_tokens=6)
    assert report.weight_dtype == "int8" and "int8 weights" in report.summary()
    agreement = next(c for c in report.quality if c.name == "greedy agreement")
    assert "(min 0.85)" in agreement.detail  # int8's limit, not float32's 0.95
    assert report.max_abs_logit_delta > 1e-3  # quantization moves logits past what float32 kernels may
    assert report.verdict == "pass", report.summary()
