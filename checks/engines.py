"""Engines for the gates: settings a check needs, factories over loaded weights, and running prompts."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from engine.core.llm_engine import LLMEngine
from engine.config.sampling_params import SamplingParams
from engine.config.variant import VariantSpec


@dataclass(frozen=True)
class GateSettings:
    num_kv_blocks: int
    enable_prefix_caching: bool
    speculate: bool = True  # False: the variant's speculation off (the contamination gate's run alone)


EngineFactory = Callable[[GateSettings], LLMEngine]


def factory_for(base: LLMEngine, spec: VariantSpec) -> EngineFactory:
    """Engines of ``spec`` over ``base``'s loaded weights (no reload)."""
    def make(s: GateSettings) -> LLMEngine:
        variant = dataclasses.replace(spec, enable_prefix_caching=s.enable_prefix_caching,
                                      speculative_tokens=spec.speculative_tokens if s.speculate else 0)
        return LLMEngine(dataclasses.replace(base.config, num_kv_blocks=s.num_kv_blocks, variant=variant), base.loaded)
    return make


# ---- running prompts ---------------------------------------------------------------------------------
def drain(eng: LLMEngine, rids: list[str], done: dict[str, list[int]]) -> None:
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.token_ids


def generate_tokens(eng: LLMEngine, prompts: list[list[int]], max_tokens: int, forced: list[list[int]] | None = None,
              record_logits: bool = False) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """All prompts together; returns tokens and (optionally) each request's per-step logits."""
    logits: dict[str, list[torch.Tensor]] = {}
    if record_logits:
        def sink(rids, rows):
            for rid, row in zip(rids, rows):
                logits.setdefault(rid, []).append(row.detach().float().cpu().clone())
        eng.logits_sink = sink
    rids = [eng.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                              forced_tokens=tuple(forced[i]) if forced else ()))
            for i, p in enumerate(prompts)]
    done: dict[str, list[int]] = {}
    try:
        drain(eng, rids, done)
    finally:
        eng.logits_sink = None
    return [done[r] for r in rids], [logits.get(r, []) for r in rids]


def blocks_needed(prompts, max_tokens, block_size) -> int:
    return max(-(-(len(p) + max_tokens) // block_size) for p in prompts)


