"""Steps with prefill tokens run through the static buffers of engine/worker/step_graphs.py (eagerly here: a CPU
captures no graphs) give the logits of the plain step, for chunked prefills, prefix-cache hits and prefill chunks
beside decode rows, each padded to the next size; a model with MoE layers is not given such graphs."""
from __future__ import annotations

import json
import random

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams, VariantSpec
from engine.config.source import ModelSource

DENSE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 96, "hidden_size": 32,
         "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 8, "max_position_embeddings": 256, "rms_norm_eps": 1e-5}


@pytest.fixture
def dense(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(DENSE))
    return path


def test_a_padded_step_through_static_buffers_gives_the_plain_steps_logits(dense):
    variant = VariantSpec(max_num_seqs=4, max_num_batched_tokens=40, prefill_chunk_size=16, block_size=8)
    eng = LLMEngine(EngineConfig(source=ModelSource("synthetic", dense, seed=5), num_kv_blocks=96, variant=variant,
                                 load_tokenizer=False))
    runner = eng.runner
    steps = runner.capture_step_graphs(eng.ops, (16, 24, 40), variant.max_num_seqs, capture=False)
    # before a step fills them, the buffers send every KV write to the scratch block (a capture runs them once)
    assert bool((steps.tokens[2] == eng.kv.scratch_block * variant.block_size).all())
    plain = runner.run
    seen: list[tuple[int, int]] = []

    def both(batch, ops, ahead=False):
        runner.step_graphs = None
        want = plain(batch, ops, ahead)
        runner.step_graphs = steps
        used = steps.fits(batch, ahead)
        got = plain(batch, ops, ahead)
        if used:
            seen.append((sum(i.num_new_tokens for i in batch.scheduled), len(batch.scheduled)))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        return got

    runner.run = both
    rng = random.Random(11)
    shared = [rng.randrange(1, 96) for _ in range(24)]  # a prefix the cache serves to the later prompts
    prompts = [shared + [rng.randrange(1, 96) for _ in range(n)] for n in (3, 17, 9)]
    prompts += [[rng.randrange(1, 96) for _ in range(n)] for n in (5, 33)]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    eng.add_request(prompts[0], params)
    for _ in range(3):
        eng.step()
    for p in prompts[1:]:
        eng.add_request(p, params)
    while eng.has_unfinished():
        eng.step()
    assert seen, "no step went through the step buffers"
    assert any(n not in (16, 24, 40) for n, _ in seen)  # padded to the next size
    assert any(k > 1 for _, k in seen)  # prefill chunks beside other rows
    assert eng.block_manager.stats.hits > 0  # contexts longer than the step's new tokens
    assert not steps.fits(type("B", (), {"scheduled": []})())


def test_a_model_with_moe_layers_gets_no_step_graphs():
    import dataclasses
    from pathlib import Path

    from engine.core import variant_swap

    tiny = Path(__file__).parent / "tiny_moe" / "config.json"
    eng = LLMEngine(EngineConfig(source=ModelSource("synthetic", tiny, seed=3), num_kv_blocks=16, load_tokenizer=False))
    ctx = dataclasses.replace(variant_swap.context(eng), device=torch.device("cuda"))  # checked before a capture
    notes: list[str] = []
    spec = VariantSpec(prefill_graph_tokens=(64,), kernels={"attention": "triton_paged"})
    assert variant_swap.graphs_for(ctx, spec, eng.ops, eng.kv, notes) is None
    assert any("MoE layers" in n for n in notes)


def test_prefill_graphed_chunks_a_step_long_and_graphs_every_size_up_to_it():
    from engine.config.presets import prefill_graphed
    from engine.errors import ConfigError

    base = VariantSpec(max_num_batched_tokens=2048, prefill_chunk_size=512)
    got = prefill_graphed(base)
    assert got.prefill_chunk_size == 2048 and got.prefill_graph_tokens == (128, 256, 512, 1024, 2048)
    assert prefill_graphed(VariantSpec(max_num_batched_tokens=100)).prefill_graph_tokens == (100,)
    assert VariantSpec.from_json(got.to_json()) == got and got.variant_id != base.variant_id
    assert VariantSpec().variant_id == VariantSpec(prefill_graph_tokens=()).variant_id  # recorded ids stay valid
    assert VariantSpec(prefill_graph_tokens=[512, 128, 512]).prefill_graph_tokens == (128, 512)
    for bad in ([8], [1 << 20], ["512"], [True]):
        with pytest.raises(ConfigError):
            VariantSpec(prefill_graph_tokens=bad)
