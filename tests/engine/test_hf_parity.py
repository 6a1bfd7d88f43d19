"""Tiny models of every supported family: our logits equal the transformers classes' with the same weights.

The Hugging Face model is initialised randomly, saved as a (sharded) safetensors folder,
and loaded by our loader, so the loader's name mapping and fusing are checked too.
"""
from __future__ import annotations

import json

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams, VariantSpec, resolve
from kernels.attention.attention import AttentionMetadata
from engine.worker.model_runner import KVCache
from engine.model.rope import rope_cos_sin

BASE = dict(vocab_size=101, hidden_size=48, intermediate_size=72, num_hidden_layers=3, num_attention_heads=6,
            num_key_value_heads=2, max_position_embeddings=256)


def _configs():
    import transformers as tf

    return {
        "llama": tf.LlamaConfig(**BASE, rope_theta=500000.0, tie_word_embeddings=False,
                                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        "llama_tied": tf.LlamaConfig(**BASE, tie_word_embeddings=True),
        "qwen2": tf.Qwen2Config(**BASE, tie_word_embeddings=False),
        "qwen3": tf.Qwen3Config(**BASE, head_dim=16, tie_word_embeddings=True),
        "qwen3_moe": tf.Qwen3MoeConfig(**BASE, head_dim=8, num_experts=5, num_experts_per_tok=2,
                                       moe_intermediate_size=24, norm_topk_prob=False, mlp_only_layers=[1]),
        "qwen3_moe_norm": tf.Qwen3MoeConfig(**BASE, num_experts=4, num_experts_per_tok=3, moe_intermediate_size=16,
                                            norm_topk_prob=True),
        "mixtral": tf.MixtralConfig(**BASE, num_local_experts=4, num_experts_per_tok=2),
    }


def _hf_model(name: str):
    import transformers as tf

    cfg = _configs()[name]
    cls = {"llama": tf.LlamaForCausalLM, "qwen2": tf.Qwen2ForCausalLM, "qwen3": tf.Qwen3ForCausalLM,
           "qwen3_moe": tf.Qwen3MoeForCausalLM, "mixtral": tf.MixtralForCausalLM}[cfg.model_type]
    torch.manual_seed(hash(name) % 1000)
    model = cls(cfg).eval()
    with torch.no_grad():  # norms start at exactly 1 and biases at 0: perturb them so they are checked
        for n, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def our_logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Logits at every prompt position, from one prefill over a fresh paged cache."""
    cfg = engine.model_config
    bs = 4
    kv = KVCache(cfg, num_blocks=len(ids) // bs + 2, block_size=bs, device="cpu", dtype=torch.float32)
    blocks = list(range(len(ids) // bs + 1))[::-1]  # deliberately not in order
    slots = [blocks[p // bs] * bs + p % bs for p in range(len(ids))]
    attn = AttentionMetadata.build(torch.tensor(slots), torch.tensor([blocks], dtype=torch.int32), [len(ids)],
                                   [0, len(ids)], "cpu")
    with torch.inference_mode():
        h = engine.model(torch.tensor(ids), torch.arange(len(ids)), rope_cos_sin(cfg, 256, "cpu"), kv.layers(),
                         attn, engine.ops)
        return engine.model.compute_logits(h)


@pytest.mark.parametrize("name", list(_configs()))
def test_logits_match_transformers(name, tmp_path):
    hf = _hf_model(name)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")  # several shards and an index
    assert (tmp_path / "model.safetensors.index.json").is_file()
    engine = LLMEngine(EngineConfig(source=resolve(str(tmp_path)), num_kv_blocks=64, variant=VariantSpec(block_size=4)))
    assert engine.model_config.model_type == hf.config.model_type
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, BASE["vocab_size"], (37,), generator=gen).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    ours = our_logits(engine, ids)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)

    # And through the full engine: greedy decode equals transformers' greedy generate.
    with torch.no_grad():
        hf_tokens = hf.generate(torch.tensor([ids[:20]]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, 20:].tolist()
    out = engine.generate([ids[:20]], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert out.token_ids == hf_tokens


def test_partial_layers_match_truncated_transformers(tmp_path):
    """layers=N loads the first N decoder layers: equal to a transformers model cut to N layers."""
    hf = _hf_model("qwen3")
    hf.save_pretrained(tmp_path)
    engine = LLMEngine(EngineConfig(source=resolve(str(tmp_path)), num_kv_blocks=64, variant=VariantSpec(block_size=4), layers=2))
    assert engine.model_config.num_hidden_layers == 2 and len(engine.model.layers) == 2
    hf.model.layers = hf.model.layers[:2]
    hf.config.num_hidden_layers = 2
    ids = list(range(3, 30))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(our_logits(engine, ids), ref, rtol=1e-4, atol=1e-4)


def test_config_json_round_trip_of_presets():
    from engine.config.model_config import ModelConfig
    from engine.loader.model_source import PRESETS_DIR

    llama = ModelConfig.from_file(PRESETS_DIR / "llama-3.1-8b.json")
    assert (llama.num_hidden_layers, llama.num_key_value_heads, llama.rope_scaling.kind) == (32, 8, "llama3")
    moe = ModelConfig.from_file(PRESETS_DIR / "qwen3-30b-a3b.json")
    assert moe.is_moe and moe.num_experts == 128 and moe.num_experts_per_tok == 8 and moe.qk_norm
    assert json.loads(json.dumps(moe.to_json()))["num_experts"] == 128


def test_tokenizer_from_model_folder(tmp_path, smollm2_engine_factory):
    """A safetensors folder with tokenizer files: text prompts and the chat template work from it."""
    import transformers as tf

    gguf_engine = smollm2_engine_factory(num_kv_blocks=8)
    gguf_engine.tokenizer.hf.save_pretrained(tmp_path)
    torch.manual_seed(0)
    tf.LlamaForCausalLM(tf.LlamaConfig(**{**BASE, "vocab_size": 49152})).save_pretrained(tmp_path)
    engine = LLMEngine(EngineConfig(source=resolve(str(tmp_path)), num_kv_blocks=16))
    assert engine.tokenizer is not None
    text = "What is the capital of France?"
    assert engine.encode_prompt(text) == gguf_engine.encode_prompt(text)
    assert engine.encode_prompt(text, chat=True) == gguf_engine.encode_prompt(text, chat=True)
    out = engine.generate([text], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and isinstance(out.text, str)


def test_synthetic_weights_are_reproducible():
    from engine.config.source import ModelSource
    from pathlib import Path

    tiny = Path(__file__).parent / "tiny_moe" / "config.json"
    a = LLMEngine(EngineConfig(source=ModelSource("synthetic", tiny, seed=3), num_kv_blocks=8, load_tokenizer=False))
    b = LLMEngine(EngineConfig(source=ModelSource("synthetic", tiny, seed=3), num_kv_blocks=8, load_tokenizer=False))
    c = LLMEngine(EngineConfig(source=ModelSource("synthetic", tiny, seed=4), num_kv_blocks=8, load_tokenizer=False))
    wa, wb, wc = (e.model.layers[0].mlp.w13 for e in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert wa.device.type == "cpu" and not wa.is_meta
