"""Weight precision as a variant: SmolLM2 with int8 weights answers like the checkpoint, the quantized copies
are made once, a swap to int8 and a rollback leave the checkpoint's weights untouched, and the gates judge a
precision by its own thresholds."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import SamplingParams, VariantSpec
from engine.errors import ConfigError, VariantError
from engine.model.precision import dense_weights, quantized_bytes, quantized_weights

FRANCE = "What is the capital of France?"


def _contamination(engine) -> list[list[int]]:
    """Two of each half of the gates' contamination prompts (checks/prompts.py): a block at position 0 and again
    at position 1, and prompts sharing three full blocks. The scenarios over all eight: tests/checks/test_gates.py;
    here they run on the whole model under a precision's tolerance, where every prompt costs seconds."""
    from checks.prompts import contamination_prompts

    every = contamination_prompts(engine, 16)
    return every[:2] + every[4:6]


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


def test_fp8_accumulation_is_validated_and_leaves_older_ids_alone():
    with pytest.raises(ConfigError, match="fp8_accumulation must be one of float32, fast"):
        VariantSpec(weight_dtype="fp8", fp8_accumulation="half")
    with pytest.raises(ConfigError, match="applies to weight_dtype fp8, not int8"):
        VariantSpec(weight_dtype="int8", fp8_accumulation="fast")
    plain, fast = VariantSpec(weight_dtype="fp8"), VariantSpec(weight_dtype="fp8", fp8_accumulation="fast")
    assert plain.variant_id == VariantSpec.from_json({"weight_dtype": "fp8"}).variant_id != fast.variant_id
    assert VariantSpec.from_json(fast.to_json()) == fast and fast.changed_scopes(plain) == {"forward"}


def test_generated_linear_kernels_refuse_quantized_weights(smollm2_engine_factory):
    eng = smollm2_engine_factory(num_kv_blocks=8)
    # refused before the generated source is even checked: it takes the checkpoint's weights only
    spec = dataclasses.replace(eng.variant, weight_dtype="int8", kernels={"act_linear": "generated:gen.act_linear"},
                               generated_source={"gen": "def act_linear(x, weight):\n    return x\n"})
    before = eng.variant
    with pytest.raises(VariantError, match="cannot run generated kernels for act_linear"):
        eng.swap_variant(spec)
    assert eng.variant == before


@pytest.mark.slow  # the gates on the whole model: quality, then the contamination scenarios
def test_gates_judge_a_precision_by_its_own_thresholds(smollm2_engine_factory):
    from checks.gates import gate_variant

    base = smollm2_engine_factory(num_kv_blocks=8)
    prompts = [base.encode_prompt(FRANCE, chat=True), base.encode_prompt("Name three colors.", chat=True)]
    report = gate_variant(base, VariantSpec(weight_dtype="int8"), prompts=prompts, max_tokens=6,
                          contamination=_contamination(base))
    assert report.weight_dtype == "int8" and "int8 weights" in report.summary()
    agreement = next(c for c in report.quality if c.name == "greedy agreement")
    assert "(min 0.85)" in agreement.detail  # int8's limit, not float32's 0.95
    assert report.max_abs_logit_delta > 1e-3  # quantization moves logits past what float32 kernels may
    assert report.verdict == "pass", report.summary()


def test_fp8_kv_cache_answers_and_swaps_with_twice_the_blocks(smollm2_engine_factory):
    from engine.worker import kv_calibration
    eng = smollm2_engine_factory(num_kv_blocks=16)
    assert eng.kv.pool.dtype == torch.float32
    plain = eng.generate([FRANCE], SamplingParams(max_tokens=16), chat=True)[0]
    report = eng.swap_variant(dataclasses.replace(eng.variant, kv_cache_dtype="fp8"))
    assert "kv_layout" in report.scopes
    assert eng.kv.pool.dtype == torch.float8_e4m3fn and eng.kv.num_blocks == 16 * 4  # the same bytes, 1 of 4 each
    out = eng.generate([FRANCE], SamplingParams(max_tokens=16), chat=True)[0]
    assert out.text == plain.text == "The capital of France is Paris."
    scales = kv_calibration.kv_scales(eng, eng.ops)
    assert len(scales) == eng.model_config.num_hidden_layers and all(s >= 1.0 for pair in scales for s in pair)
    eng.rollback()
    assert eng.kv.pool.dtype == torch.float32 and eng.kv.num_blocks == 16
    assert eng.generate([FRANCE], SamplingParams(max_tokens=16), chat=True)[0].token_ids == plain.token_ids


def test_fp8_kv_scales_are_applied_and_undone(smollm2_engine_factory):
    """Keys cached divided by their scale with the scores multiplied back, values divided with the output
    multiplied back: over a float32 cache, where powers of two divide exactly, the same logits; over the FP8
    cache the keys really are cached scaled."""
    from engine.model import precision
    eng = smollm2_engine_factory(num_kv_blocks=16)
    layers = eng.model_config.num_hidden_layers
    sink: list[torch.Tensor] = []
    eng.logits_sink = lambda ids, logits: sink.append(logits.clone())
    params = SamplingParams(max_tokens=4)
    first = eng.generate([FRANCE], params, chat=True)[0].token_ids
    amax, vmax = eng.kv.pool[0, 0].abs().amax(), eng.kv.pool[0, 1].abs().amax()
    eng.ops = precision.fp8_kv_ops(eng.ops, [(4.0, 0.25)] * layers)
    eng.block_manager.reset_prefix_cache()
    eng.kv.pool.zero_()  # only what the second run caches
    assert eng.generate([FRANCE], params, chat=True)[0].token_ids == first
    eng.logits_sink = None
    torch.testing.assert_close(torch.cat(sink[len(sink) // 2:]), torch.cat(sink[: len(sink) // 2]), rtol=1e-4,
                               atol=1e-4)
    torch.testing.assert_close(eng.kv.pool[0, 0].abs().amax(), amax / 4)  # the keys as cached: divided by 4
    torch.testing.assert_close(eng.kv.pool[0, 1].abs().amax(), 4 * vmax)  # the values: divided by 1/4


def test_kv_scales_are_powers_of_two_with_headroom():
    from engine.worker.kv_calibration import _pow2_scale

    assert [_pow2_scale(a) for a in (0.0, 100.0, 224.0, 300.0, 1000.0)] == [1.0, 1.0, 1.0, 2.0, 8.0]


@pytest.mark.slow  # the gates on the whole model
def test_gates_judge_an_fp8_kv_cache_by_fp8_thresholds(smollm2_engine_factory):
    from checks.gates import gate_variant

    base = smollm2_engine_factory(num_kv_blocks=8)
    report = gate_variant(base, VariantSpec(kv_cache_dtype="fp8"), prompts=[base.encode_prompt(FRANCE, chat=True)],
                          max_tokens=6, contamination=_contamination(base))
    assert report.kv_cache_dtype == "fp8" and "fp8 KV cache" in report.summary()
    assert "(min 0.8)" in next(c for c in report.quality if c.name == "greedy agreement").detail
    assert report.greedy_agreement >= 0.8 and report.mean_kl < 0.05
    # the scenarios under the FP8 cache's tolerance, unless the quality checks already rejected it (max |dlogit|
    # sits near its limit on SmolLM2: bench/RESULTS.md)
    assert report.contamination_skipped or all(c.passed for c in report.contamination), report.summary()


def test_quantized_copies_are_keyed_by_the_weights_hash():
    from engine import EngineConfig, LLMEngine
    from engine.config.source import ModelSource
    from engine.model.precision import _bit_sums, _content_digest, weights_hash
    from tests.engine.test_variants import TINY

    def tiny(seed):
        return LLMEngine(EngineConfig(source=ModelSource("synthetic", TINY, seed=seed), num_kv_blocks=16,
                                      load_tokenizer=False)).model

    model = tiny(1)
    h = weights_hash(model)
    assert weights_hash(model) == h and weights_hash(tiny(1)) == h  # the same contents: the same hash
    assert weights_hash(tiny(2)) != h
    table = quantized_weights(model, "int8")
    assert quantized_weights(model, "int8") is table  # cached while the weights stay
    w = dense_weights(model)[3]
    first = w[0, 0].clone()
    with torch.no_grad():
        w[0, 0] += 1.0  # a weight changed in place (as a checkpoint loaded into the same model)
    assert weights_hash(model) != h
    again = quantized_weights(model, "int8")
    assert again is not table
    fresh = torch.round(w[0] / again[id(w)].scale[0]).clamp(-127, 127).to(torch.int8)
    assert torch.equal(again[id(w)].q[0], fresh) and not torch.equal(table[id(w)].q[0], fresh)
    with torch.no_grad():
        w[0, 0] = first
    assert weights_hash(model) == h  # back to the first contents
    # any single bit of a value changes the digest; a float and its bits' neighbour differ
    x = torch.randn(5000)
    y = x.clone()
    y[4321] = torch.nextafter(y[4321], torch.tensor(float("inf")))
    assert _content_digest(x) != _content_digest(y) and _content_digest(x) == _content_digest(x.clone())
    assert _bit_sums(x) != _bit_sums(y) and _bit_sums(x) == _bit_sums(x.clone())  # the GPU's form
    z = x.clone()
    z[[10, 20]] = z[[20, 10]]  # two values swapped: the same plain sum, not the same weighted one
    assert _bit_sums(z) != _bit_sums(x)
