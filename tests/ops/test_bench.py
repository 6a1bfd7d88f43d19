"""The two benchmark tiers measure what they say (a tiny synthetic model keeps them quick)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from engine import EngineConfig, LLMEngine, VariantSpec
from engine.config.source import ModelSource
from ops.measure.tiers import SLO, fast_tier, slow_tier
from ops.traffic.replay import synthesize_prompts
from ops.traffic.traces import load_trace

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "engine" / "tiny_moe" / "config.json"
AZURE = ROOT / "traces" / "AzureLLMInferenceTrace_conv.csv"


def _engine(**kw) -> LLMEngine:
    return LLMEngine(EngineConfig(source=ModelSource("synthetic", TINY, seed=0), num_kv_blocks=256, variant=VariantSpec(block_size=4),
                                  load_tokenizer=False, **kw))


def test_slow_tier_replays_the_slice():
    records = load_trace(AZURE)[:10]
    prompts = synthesize_prompts(records, 64, max_input=40, low=1)
    eng = _engine()
    r = slow_tier(eng, records, prompts, "azure[:10]", repeats=3, time_scale=0.01, max_output=6,
                  slo=SLO(ttft_s=60, tpot_s=60))
    assert r.tier == "slow" and r.repeats == 3 and r.variant_id == eng.variant.variant_id
    assert r.output_tok_s > 0 and r.total_tok_s > r.output_tok_s and r.spread >= 0
    assert 0 < r.ttft_p50 <= r.ttft_p90 <= r.ttft_p99 <= r.e2e_p99
    assert r.tpot_p50 <= r.tpot_p99 and r.e2e_p50 <= r.e2e_p90
    assert r.goodput > 0  # a generous SLO: every request counts
    # three replays, and the untimed warm-up: two short requests of two tokens, then alone the longest prompt and
    # up to 97 of its tokens reversed, one token each (prefill-sized steps compile before the timed replays)
    assert eng.stats.generation_tokens == 3 * sum(min(x.output_tokens, 6) for x in records) + 2 * 2 + 2
    strict = slow_tier(_engine(), records, prompts, "azure[:10]", repeats=1, time_scale=0.01, max_output=6,
                       slo=SLO(ttft_s=0.0, tpot_s=0.0))
    assert strict.goodput == 0.0


def test_fast_tier_times_each_shape():
    r = fast_tier(_engine(), [8, 30], [(1, 12), (4, 12)], repeats=3, decode_steps=2)
    assert set(r.step_times_ms) == {"prefill n=8", "prefill n=30", "decode b=1 ctx=12", "decode b=4 ctx=12"}
    assert all(v > 0 for v in r.step_times_ms.values())
    assert r.output_tok_s == (1 + 4) / (r.step_times_ms["decode b=1 ctx=12"] / 1e3 + r.step_times_ms["decode b=4 ctx=12"] / 1e3)


def test_bench_cli_prints_a_bench_result():
    r = subprocess.run([sys.executable, "-m", "pipelines.cli", "bench", "--model", str(TINY.parent), "--synthetic",
                        "--tier", "slow", "--trace", str(AZURE), "--requests", "5", "--time-scale", "0.01",
                        "--max-input", "20", "--max-output", "4", "--repeats", "1"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["tier"] == "slow" and out["trace_id"].endswith("[:5]") and out["output_tok_s"] > 0
