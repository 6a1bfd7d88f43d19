"""Prompt sets for the gates: shipped prompts, prompts shaped to catch cache faults, and trace-shaped prompts."""
from __future__ import annotations

import random

SHIPPED = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "List three primary colors:",
    "Water boils at a temperature of",
    "The theory of general relativity was written by",
    "Translate to French: good morning, my friend.",
    "A haiku about autumn leaves:",
]
SYSTEM = ("You are a careful assistant. Answer briefly and precisely, and never invent facts. "
          "The user asks about geography, history and science, and expects one short sentence. ")


def shipped_prompts(engine) -> list[list[int]]:
    """Token ids of the shipped prompts; random ids of the same count when the model has no tokenizer."""
    if engine.tokenizer is not None:
        return [engine.encode_prompt(p) for p in SHIPPED]
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    return [[rng.randrange(vocab) for _ in range(5 + 3 * i)] for i in range(len(SHIPPED))]


def contamination_prompts(engine, block_size: int) -> list[list[int]]:
    """Prompts that share prefixes, repeat a block at another position, and end in partial blocks.

    Order matters: the first half is admitted before the second, so the second half meets the
    first half's cached blocks.
    """
    base = shipped_prompts(engine)
    if engine.tokenizer is not None:
        prefix = engine.encode_prompt(SYSTEM * 2)[: 3 * block_size]
    else:
        prefix = [(7 * i + 3) % engine.model_config.vocab_size for i in range(3 * block_size)]
    block = prefix[:block_size]
    other = prefix[block_size : 2 * block_size]
    first_half = [
        block + other + base[0],  # X: block B at position 0
        prefix + base[1],
        base[2],
        base[3] + base[4],
    ]
    second_half = [
        block + block + base[5],  # Y: the same block B again at position 1: a position-blind hash reuses X's
        prefix + base[6],  # shares three full blocks with a first-half prompt
        base[7],
        prefix + base[1],  # identical to a first-half prompt
    ]
    return first_half + second_half


def trace_prompts(lengths: list[int], vocab_size: int, seed: int = 0, low: int = 100) -> list[list[int]]:
    """Random token ids of the given lengths (prompts shaped like a trace's)."""
    rng = random.Random(seed)
    return [[rng.randint(low, max(low + 1, vocab_size - 1)) for _ in range(max(1, n))] for n in lengths]
