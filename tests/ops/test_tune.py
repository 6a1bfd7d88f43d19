"""A whole search on SmolLM2 (a few layers, a small trace slice): agents including the LLM agent
against a scripted server, both tiers, the cost model's error, and a decision resting on results."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ops.search.board import DONE, Board
from ops.search.tune import Budget, default_agents, tune
from ops.search.config import SearchConfig

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "traces" / "AzureLLMInferenceTrace_conv.csv"

REPLY = {"proposals": [{"rationale": "chunk prompts so decodes keep flowing",
                        "changes": {"prefill_chunk_size": 16, "max_num_batched_tokens": 48}}]}


@pytest.mark.slow
def test_tune_with_built_in_and_llm_agents(tmp_path, scripted_server):
    from ops.search.llm_agent import LLMAgent

    url, handler = scripted_server
    handler.script = [json.dumps(REPLY), "not json at all"] * 4
    board_path = tmp_path / "board.db"
    cfg = SearchConfig(trace=str(TRACE), requests=6, max_input=32, max_output=4, time_scale=0.0, fast_layers=1,
                       slow_layers=2, fast_repeats=1, slow_repeats=2)
    agents = default_agents()
    agents.insert(2, LLMAgent(base_url=url, model="scripted", board=Board(board_path)))
    report = tune(cfg, board_path, agents, Budget(experiments=10, seconds=600), slow_top=2, per_agent=1)
    rows = report.rows
    assert len(rows) <= 10  # speculation's two slow-tier settings and the precision candidate within the budget
    assert all(r["status"] == DONE and r["result_id"] for r in rows)
    fast = [r for r in rows if r["tier"] == "fast"]
    slow = [r for r in rows if r["tier"] == "slow"]
    assert fast[0]["proposer"] == "baseline" and slow[0]["name"].startswith("static-best")
    assert {"cost-model", "llm"} <= {r["proposer"] for r in fast}
    # static-best, the fast tier's two best, static-best with prompt-lookup speculation (real text: SmolLM2),
    # static-best with int8 weights (no FP8 tensor cores here) and a second setting of speculation's policy
    # chosen from the first one's measured acceptance
    assert len(slow) == 6 and report.cost_model["variants"] == 6
    quant = next(r for r in slow if r["name"] == "static-best + int8 weights")
    assert quant["weight_dtype"] == "int8" and "the quality gate decides" in quant["rationale"]
    gated = [m["body"] for m in Board(board_path).messages("note")
             if m["body"].get("search") == report.search and m["body"].get("variant_id") == quant["variant_id"]]
    if gated and gated[0]["verdict"] != "pass":  # a failed gate excludes it from the decision
        assert report.chosen["variant_id"] != quant["variant_id"] and "excluded" in report.decision["reason"]
    if report.chosen["variant_id"] == quant["variant_id"]:  # chosen only after its gates passed
        assert gated and gated[0]["verdict"] == "pass" and report.quality["verdict"] == "pass"
    assert "precision: static-best + int8 weights: capacity" in report.text()
    spec = next(r for r in slow if r["name"] == "static-best + prompt lookup 4")
    assert "acceptance depends on the text" in spec["rationale"] and spec["spec_accepted_length"] >= 1
    follow = slow[-1]
    assert follow["name"] in ("static-best + prompt lookup 8", "static-best + prompt lookup 4, 2-grams")
    assert f"accepted at {spec['spec_acceptance']:.0%}" in follow["rationale"]
    llm_row = next(r for r in fast if r["proposer"] == "llm")
    assert "chunk prompts" in llm_row["rationale"]
    # the decision rests on slow-tier results that exist on the board, and says why
    board = Board(board_path)
    slow_ids = {r.id for r, _ in board.results(report.search, "slow")}
    assert report.decision["refs"] and set(report.decision["refs"]) <= slow_ids
    decisions = [m for m in board.messages("decision") if m["body"]["search"] == report.search]
    assert len(decisions) == 1 and decisions[0]["refs"] == report.decision["refs"]
    assert report.chosen["variant_id"] == report.decision["variant_id"]
    for key in ("mape_calibrated", "mape_roofline", "spearman_cost_model", "spearman_fast_tier"):
        assert key in report.cost_model
    assert report.cost_model["mape_calibrated"] >= 0
    text = report.text()
    assert "decision:" in text and "MAPE" in text and report.search in text
    assert report.invalid_replies == (1 if len(handler.requests) > 1 else 0)


@pytest.mark.parametrize("args, message", [
    (["--trace", "/nonexistent.csv"], "trace not found"),
    (["--trace", str(TRACE), "--budget", "1"], "at least 2 experiments"),
])
def test_tune_cli_refuses_bad_input(args, message, tmp_path):
    out = subprocess.run([sys.executable, "-m", "pipelines.cli", "tune", "--board", str(tmp_path / "b.db"), *args],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 2 and message in out.stderr and out.stderr.count("\n") == 1


def test_worker_cli_unknown_search(tmp_path):
    Board(tmp_path / "b.db").close()
    out = subprocess.run([sys.executable, "-m", "pipelines.cli", "worker", "--board", str(tmp_path / "b.db"),
                          "--search", "nope"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 2 and "no search 'nope'" in out.stderr


@pytest.mark.slow
def test_tune_measures_templated_kernels_like_any_variant(tmp_path):
    """The offline producer of generated code in a real search: its kernel is checked, smoke-run in an isolated
    child and measured by the workers on both tiers like any other proposal."""
    from ops.search.agents import CostModelSeeder, KernelTemplates

    cfg = SearchConfig(trace=str(TRACE), requests=4, max_input=24, max_output=3, time_scale=0.0, fast_layers=1,
                       slow_layers=1, fast_repeats=1, slow_repeats=1)
    agents = [KernelTemplates(on_cpu=True, ops=("silu_and_mul",)), CostModelSeeder()]
    report = tune(cfg, tmp_path / "board.db", agents, Budget(experiments=5, seconds=900), slow_top=1, per_agent=1,
                  speculation=False, precision=False)  # both: the search above
    tpl = [r for r in report.rows if r["proposer"] == "kernel-templates"]
    assert tpl and all(r["status"] == DONE and r["result_id"] for r in tpl), report.rows
    assert "silu_and_mul: silu_tile" in tpl[0]["rationale"]


@pytest.mark.slow
def test_tune_measures_parallel_layouts_served(tmp_path):
    """On two devices' worth of process groups (gloo on this CPU) the search measures static-best on one device, in
    tensor parallel (tp 2) and as two replicas behind the router (dp 2), each served and replayed over HTTP, each
    layout's start timed; the decision compares them like any variants."""
    model = tmp_path / "tiny" / "config.json"
    model.parent.mkdir()
    model.write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 512}))
    import dataclasses

    from engine.config.variant import VariantSpec

    cfg = SearchConfig(model=str(model), trace=str(TRACE), requests=6, max_input=48, max_output=4,
                       time_scale=0.0, fast_layers=1, fast_repeats=1, slow_repeats=1, capacity_probes=2,
                       num_kv_blocks=64, layout_devices=2, slo_ttft_s=5.0, slo_tpot_s=1.0)
    report = tune(cfg, tmp_path / "board.db", [], Budget(experiments=4, seconds=600), slow_top=0,
                  speculation=False, precision=False, baseline=dataclasses.replace(VariantSpec(name="static-best")))
    slow = {(r.get("tp"), r.get("dp")): r for r in report.rows if r["tier"] == "slow"}
    assert all(r["status"] == DONE for r in report.rows), [(r["name"], r["error"]) for r in report.rows]
    assert set(slow) == {(1, 1), (2, 1), (1, 2)}, [(r["name"], r["tier"]) for r in report.rows]
    for r in slow.values():
        assert r["status"] == DONE and r["output_tok_s"] > 0 and r["start_s"] > 0, r
    assert "tp 2 x dp 1 on 2 devices" in slow[(2, 1)]["rationale"]
    text = report.text()
    assert "layout: static-best, tp 1 x dp 2: capacity" in text and "restart-scope swap" in text
    assert report.decision["refs"]
