"""Timing shared by the benchmarks: batch-1 decode timed after its first token, and arms measured in alternation
(A B C, A B C, ...) so that a drift of the machine during a run falls on every arm alike."""
from __future__ import annotations

import time
from collections.abc import Callable


def decode_rate(eng, prompt, max_tokens: int, sync: Callable[[], None] = lambda: None) -> tuple[int, float]:
    """(tokens after the first, seconds they took) for one greedy answer at batch 1 on ``eng`` (an LLMEngine):
    the prefill and first token run before the clock starts. ``sync``: waits for the device (a GPU's queue)."""
    from engine import SamplingParams

    eng.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    eng.step()  # the prefill and the first token
    sync()
    t0 = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    sync()
    return max_tokens - 1, time.perf_counter() - t0


def alternate(arms: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Each arm's figure per round, the arms run in turn within every round."""
    out: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(rounds):
        for name, measure in arms.items():
            out[name].append(measure())
    return out
