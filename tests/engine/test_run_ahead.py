"""Decode launched one step ahead of the host gives exactly the tokens of the plain step loop."""
from __future__ import annotations

from pathlib import Path

from engine import EngineConfig, LLMEngine, SamplingParams, VariantSpec
from engine.config.source import ModelSource

TINY = Path(__file__).parent / "tiny_moe" / "config.json"


def _engine(ahead: bool) -> LLMEngine:
    return LLMEngine(EngineConfig(source=ModelSource("synthetic", TINY, seed=3), num_kv_blocks=64,
                                  variant=VariantSpec(block_size=4), load_tokenizer=False, async_decode=ahead))


def _run(eng: LLMEngine, abort_after: int | None = None) -> dict[str, list[int]]:
    prompts = [[1, 5, 9, 13, 2, 7, 33], [4, 4, 8], list(range(10, 31)), [7] * 5]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (3, 11, 7, 9)]
    # a stop token: the row ends at whatever step first emits it, which the engine only learns a step late
    first = _engine(False).generate([prompts[3]], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids
    rids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    rids.append(eng.add_request(prompts[3], SamplingParams(max_tokens=20, stop_token_ids=[first[2]])))
    done: dict[str, list[int]] = {}
    steps = 0
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.token_ids
        steps += 1
        if steps == abort_after:
            eng.abort(rids[1])
    return {r: done.get(r) for r in rids}


def test_run_ahead_equals_plain_loop():
    want = _run(_engine(False))
    eng = _engine(True)
    assert _run(eng) == want
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks  # every block came back


def test_abort_while_a_step_runs_ahead():
    want = _run(_engine(False), abort_after=6)
    eng = _engine(True)
    got = _run(eng, abort_after=6)
    assert got == want
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_speculation_with_run_ahead_equals_the_plain_loop():
    """Speculation's steps go through the scheduler (never launched ahead), stop tokens inside a verified draft
    end the request there, and every token equals the plain loop's."""
    want = _run(_engine(False))
    eng = LLMEngine(EngineConfig(source=ModelSource("synthetic", TINY, seed=3), num_kv_blocks=64,
                                 variant=VariantSpec(block_size=4, speculative_tokens=3), load_tokenizer=False,
                                 async_decode=True))
    assert _run(eng) == want
    assert eng.stats.spec_drafts > 0 and eng.stats.spec_accepted_tokens > 0
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
