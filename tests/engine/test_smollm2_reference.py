"""SmolLM2 from the shipped GGUF: our greedy tokens equal Hugging Face transformers' greedy generate."""
from __future__ import annotations

import pytest
import torch

from engine import SamplingParams

PLAIN = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]
CHAT = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in one sentence.",
    "List three fruits.",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def engine(smollm2_engine_factory):
    return smollm2_engine_factory(num_kv_blocks=256)


@pytest.fixture(scope="module")
def hf_greedy(hf_smollm2, engine):
    """Hugging Face greedy continuation of each prompt, generated one prompt at a time."""
    out = {}
    for chat, prompts in ((False, PLAIN), (True, CHAT)):
        for p in prompts:
            ids = engine.encode_prompt(p, chat=chat)
            with torch.no_grad():
                gen = hf_smollm2.generate(
                    torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                    max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
                )
            out[(chat, p)] = gen[0, len(ids):].tolist()
    return out


def test_prompt_encoding_matches_hf_tokenizer(engine, smollm2_path, gguf_parsed_once):
    from transformers import AutoTokenizer

    with gguf_parsed_once():
        tok = AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)
    for p in PLAIN:
        assert engine.encode_prompt(p) == tok.encode(p)
    ids = engine.encode_prompt(CHAT[0], chat=True)
    text = tok.decode(ids)
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_greedy_matches_transformers_token_for_token(engine, hf_greedy):
    prompts = [(False, p) for p in PLAIN] + [(True, p) for p in CHAT]
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    rids = [engine.add_request(p, params, chat=chat) for chat, p in prompts]
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.token_ids
    for rid, key in zip(rids, prompts):
        assert len(done[rid]) == NEW_TOKENS
        assert done[rid] == hf_greedy[key], f"diverged on {key}"


def test_capital_of_france(engine):
    out = engine.generate(["What is the capital of France?"], SamplingParams(max_tokens=32), chat=True)[0]
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop"
