"""Tensor parallelism on CPU: two gloo ranks against one process, on the same synthetic weights."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.config.model_config import ModelConfig
from engine.errors import ConfigError
from engine.config.source import ModelSource
from engine.model.parallel import run_ranks, shard_config
from engine.config.variant import VariantSpec

TINY_MOE = Path(__file__).parent / "tiny_moe" / "config.json"
PROMPTS = [[1, 5, 9, 13, 2, 7, 33], [4, 4, 8], list(range(10, 31))]


def _llama(tmp: Path) -> Path:
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 96, "hidden_size": 64,
           "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "max_position_embeddings": 128}
    (tmp / "config.json").write_text(json.dumps(cfg))
    return tmp / "config.json"


def _run(rank: int, config_path: str, tp: int, kernels: dict) -> tuple[list, list]:
    """Greedy tokens of PROMPTS and the first step's logits (each row of the first prompt's prefill)."""
    spec = VariantSpec(tp=tp, block_size=4, kernels=kernels)
    eng = LLMEngine(EngineConfig(source=ModelSource("synthetic", Path(config_path), seed=3), num_kv_blocks=64,
                                 load_tokenizer=False, variant=spec))
    seen = []
    eng.logits_sink = lambda ids, logits: seen.append(logits.clone())
    out = [o.token_ids for o in eng.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True))]
    return out, [t.tolist() for t in seen[:2]]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("kernels", [{}, {"linear": "triton", "norm_linear": "triton", "act_linear": "triton"}],
                         ids=["reference", "gemv"])
def test_tp2_equals_tp1(tmp_path, model, kernels):
    path = _llama(tmp_path) if model == "llama" else TINY_MOE
    tokens1, logits1 = _run(0, str(path), 1, kernels)
    tokens2, logits2 = run_ranks(2, "cpu", _run, str(path), 2, kernels)
    assert tokens2 == tokens1
    assert len(logits2) == len(logits1) == 2
    for a, b in zip(logits2, logits1):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-5)


def test_tp_errors_are_clear(tmp_path):
    cfg = ModelConfig.from_file(_llama(tmp_path))
    with pytest.raises(ConfigError, match="tp=3 does not divide num_attention_heads"):
        shard_config(cfg, 3)
    with pytest.raises(ConfigError, match="needs 2 processes"):  # no torch.distributed in this process
        LLMEngine(EngineConfig(source=ModelSource("synthetic", _llama(tmp_path)), load_tokenizer=False,
                               variant=VariantSpec(tp=2)))
