"""Agents: reply validation, the LLM agent against a scripted OpenAI-compatible server on loopback and
against our own server serving SmolLM2, and the built-in agents' proposals."""
from __future__ import annotations

import functools
import json

import pytest

from engine.config.presets import PDL_OPS
from engine.serving.trace_record import TraceRecord
from engine.config.variant import VariantSpec
from ops.search.agents import LocalSearch, SearchState, TrafficRules, fast_score
from ops.search.llm_agent import InvalidReply, LLMAgent, parse_reply
from ops.search.board import Board
from ops.search.kernel_templates import KernelChoice
from ops.predict.cost_model import plan
from ops.measure.hardware import HardwareProfile
from ops.measure.model_spec import ModelSpec
from ops.traffic.traces import profile

SPEC = ModelSpec(architecture="llama", layers=30, hidden_size=576, heads=9, kv_heads=3, head_dim=64, vocab=49152,
                 experts=0, experts_per_token=0, dtype="float32", param_bytes=4 * 134_515_008,
                 kv_bytes_per_token=2 * 30 * 3 * 64 * 4, weights_hash="x", source="x")
HW = HardwareProfile(device="test", device_count=1, memory_bytes=24 << 30, memory_bandwidth=40e9,
                     matmul_flops={"float32": 3e11}, launch_overhead_s=3e-6)
BASE = VariantSpec(name="base")

VALID = {"proposals": [
    {"rationale": "smaller batches for lower TPOT", "changes": {"max_num_seqs": 8, "prefill_chunk_size": 64}},
    {"rationale": "a faster norm", "changes": {"kernels": {"rms_norm": "triton"}},
     "kernel_source": {"op": "silu_and_mul", "module": "my_act", "function": "silu_and_mul",
                       "source": KernelChoice("silu_and_mul", "silu_tile", ()).source()}},
]}


@functools.cache
def _traffic(reuse: bool, long_prompts: bool):
    """The traffic profile and the cost model's plan for it (the plan simulates every knob variant over the
    records: 9 s for the long prompts), made once per traffic and read by every state on it."""
    recs = [TraceRecord(arrival_s=i * 0.2, input_tokens=(3000 if long_prompts else 60) + 5 * i, output_tokens=50,
                        prefix_block_hashes=[1, 2] if reuse else [], block_tokens=64, source="t") for i in range(20)]
    prof = profile(recs)
    return prof, plan(SPEC, HW, prof, BASE, records=recs, max_output=8)


def _state(board: Board, search: str, reuse: bool = False, long_prompts: bool = False) -> SearchState:
    prof, cost_plan = _traffic(reuse, long_prompts)
    return SearchState.read(board, search, model_spec=SPEC, hardware=HW, traffic=prof, plan=cost_plan,
                            baseline=BASE)


def test_parse_reply_accepts_valid_and_fenced_json():
    props = parse_reply(json.dumps(VALID), BASE)
    assert props[0].variant.max_num_seqs == 8 and props[0].variant.prefill_chunk_size == 64
    assert props[0].variant.block_size == BASE.block_size  # unchanged fields come from the base
    v = props[1].variant
    assert v.impl("rms_norm") == "triton" and v.impl("silu_and_mul") == "generated:my_act.silu_and_mul"
    assert "my_act" in dict(v.generated_source)
    fenced = "Here you go:\n```json\n" + json.dumps(VALID) + "\n```\nGood luck."
    assert [p.variant for p in parse_reply(fenced, BASE)] == [p.variant for p in props]


@pytest.mark.parametrize("reply, reason", [
    (None, "empty reply"),
    ("   ", "empty reply"),
    ("The capital of France is Paris.", "not JSON"),
    ('{"proposals": []}', "schema"),
    ('{"proposals": [{"rationale": "x", "changes": {"max_num_seqs": "eight"}}]}', "schema"),
    ('{"proposals": [{"rationale": "x", "changes": {"num_gpus": 4}}]}', "schema"),
    ('{"variants": [{"max_num_seqs": 8}]}', "schema"),
    ('{"proposals": [{"rationale": "x", "changes": {"kernels": {"attention": "warp_magic"}}}]}', "not a valid variant"),
    (json.dumps({"proposals": [{"rationale": "x", "changes": {}, "kernel_source": {
        "op": "rms_norm", "module": "evil", "function": "f", "source": "import os\ndef f(x, w, eps):\n    return x\n"}}]}),
     "kernel source refused"),
    (json.dumps({"proposals": [{"rationale": "x", "changes": {}, "kernel_source": {
        "op": "rms_norm", "module": "broken", "function": "f", "source": "def f(x, w, eps) return x"}}]}),
     "not valid Python"),
])
def test_parse_reply_refuses_what_was_not_asked(reply, reason):
    with pytest.raises(InvalidReply, match=reason):
        parse_reply(reply, BASE)


def test_llm_agent_against_a_scripted_server(tmp_path, scripted_server):
    url, handler = scripted_server
    board = Board(tmp_path / "b.db")
    handler.script = [json.dumps(VALID), "I think you should raise max_num_seqs.", 500,
                      '{"proposals": [{"rationale": "x", "changes": {"block_size": 12}}]}',
                      {"id": "c2", "object": "chat.completion", "created": 0, "model": "m", "choices": [{}]},
                      {"id": "c3", "object": "chat.completion", "created": 0, "model": "m", "choices": []}]
    agent = LLMAgent(base_url=url, model="scripted-model", api_key="sk-test", board=board)
    state = _state(board, "s")
    props = agent.propose(state, 4)
    assert [p.variant.max_num_seqs for p in props][:1] == [8] and len(props) == 2
    req = handler.requests[0]
    assert req["path"] == "/v1/chat/completions" and req["auth"] == "Bearer sk-test"
    assert req["body"]["model"] == "scripted-model" and req["body"]["response_format"]["type"] == "json_schema"
    context = json.loads(req["body"]["messages"][1]["content"].split("\n", 1)[1])
    assert context["traffic"]["requests"] == 20 and "ranges" not in context and context["cost_model_ranges"]
    # prose, an HTTP 500, a schema violation, a choice without a message, no choices: recorded, never fatal
    for _ in range(5):
        assert agent.propose(state, 4) == []
    invalid = board.messages("invalid_reply")
    assert [m["body"]["reason"].split(":")[0] for m in invalid] == [
        "not JSON", "does not match the schema at proposals/0/changes/block_size",
        "the server's reply has no choices[0].message.content", "the server's reply has no choices[0].message.content"]
    assert invalid[0]["body"]["reply"].startswith("I think") and invalid[0]["body"]["search"] == "s"
    assert any("failed" in m["body"].get("error", "") for m in board.messages("note"))
    assert agent.invalid == 4


@pytest.mark.slow
def test_llm_agent_against_our_own_server_serving_smollm2(tmp_path):
    """SmolLM2 rarely writes the schema; whatever it writes is validated and recorded, and the search goes on."""
    from ops.release.deploy import ServerProcess

    server = ServerProcess(["--model", "smollm2", "--num-kv-blocks", "1024"], "smollm2")
    try:
        board = Board(tmp_path / "b.db")
        agent = LLMAgent(base_url=server.url + "/v1", model="smollm2", board=board, max_tokens=48)
        state = _state(board, "s2")
        props = agent.propose(state, 2)
        assert agent.replies == 1
        msgs = board.messages()
        if props:
            assert any(m["body"].get("valid_reply") for m in msgs)
            assert all(isinstance(p.variant, VariantSpec) for p in props)
        else:
            bad = [m for m in msgs if m["kind"] == "invalid_reply"]
            assert len(bad) == 1 and bad[0]["body"]["reason"]
            assert bad[0]["body"]["model"] == "smollm2"
    finally:
        server.stop()


def test_traffic_rules_follow_the_traffic(tmp_path):
    board = Board(tmp_path / "b.db")
    long_state = _state(board, "a", long_prompts=True)
    names = [p.variant.name for p in TrafficRules().propose(long_state, 8)]
    assert any("chunked prefill" in n for n in names)
    reuse = [p for p in TrafficRules().propose(_state(board, "b", reuse=True), 8) if "prefix" in p.rationale]
    assert reuse and reuse[0].variant.enable_prefix_caching
    short = [p.variant.name for p in TrafficRules().propose(_state(board, "c"), 8)]
    assert not any("chunked" in n for n in short)


def test_local_search_steps_around_the_best_result(tmp_path):
    board = Board(tmp_path / "b.db")
    good = VariantSpec(name="good", max_num_seqs=16)
    for v, g in ((BASE, 1.0), (good, 2.0)):
        board.enqueue("s", v, "fast", "t", "r")
        exp = board.claim("w", "s")
        board.complete(exp, "w", {"output_tok_s": 10.0, "predicted": {"capacity": g, "output_tok_s": 10.0}})
    state = _state(board, "s")
    best_result, best = state.best()
    assert best == good and fast_score(best_result.bench)[0] == 2.0
    props = LocalSearch().propose(state, 20)
    assert props and all(p.refs == (best_result.id,) for p in props)
    assert all(len(p.variant.changed_scopes(good)) == 1 for p in props)  # one knob at a time
    assert {p.variant.max_num_seqs for p in props} >= {8, 32}
    assert all(state.fresh(p.variant) for p in props)


def test_traffic_rules_fit_decode_steps_to_the_tpot_slo(tmp_path):
    from ops.predict.cost_model import Calibration

    board = Board(tmp_path / "b.db")
    state = _state(board, "t")
    assert not any("TPOT" in p.variant.name for p in TrafficRules().propose(state, 8))  # not calibrated yet
    # a step costs 10 ms per sequence: half a 200 ms TPOT holds 10 sequences, so 8 (a power of two)
    state.calibration = Calibration(mem=0.0, compute=0.0, launch=0.0, per_seq_s=0.01, fitted=True)
    state.slo_tpot_s = 0.2
    tpot = [p for p in TrafficRules().propose(state, 8) if "TPOT" in p.variant.name]
    assert tpot and {p.variant.max_num_seqs for p in tpot} == {8}
    assert "200 ms" in tpot[0].rationale and "80 ms" in tpot[0].rationale
    state.slo_tpot_s = 10.0  # every batch the baseline allows fits: nothing to propose
    assert not any("TPOT" in p.variant.name for p in TrafficRules().propose(state, 8))


def test_traffic_rules_chunk_the_prefill_when_decodes_fit_but_a_full_step_does_not(tmp_path):
    from ops.predict.cost_model import Calibration, StepShape, step_time

    state = _state(Board(tmp_path / "b.db"), "t", long_prompts=True)
    state.calibration = Calibration(mem=0.0, compute=0.1, launch=0.0, per_seq_s=0.0, fitted=True)
    state.slo_tpot_s = 0.2
    tpot = [p for p in TrafficRules().propose(state, 8) if "TPOT" in p.variant.name]
    # the baseline's 64 sequences decode within half the SLO: only the token budget changes
    assert len(tpot) == 1 and tpot[0].variant.max_num_seqs == BASE.max_num_seqs
    v = tpot[0].variant
    assert v.max_num_batched_tokens < BASE.max_num_batched_tokens and v.prefill_chunk_size == v.max_num_batched_tokens - 64

    def step(budget):  # the modelled step of the baseline's decodes plus a prefill chunk filling the budget
        ctx = int(min(state.traffic.input_p50, 10**9) + state.traffic.output_p50 / 2) + 1
        pre = budget - 64
        return step_time(SPEC, HW, StepShape(budget, 64 * ctx + pre, 65, 64 * ctx + pre * (pre + 1) // 2),
                         state.calibration)
    assert step(v.max_num_batched_tokens) <= 0.2 < step(2 * v.max_num_batched_tokens)


def test_kernel_choices_follow_device_and_concurrency(tmp_path):
    """Nothing on a CPU (Triton would run interpreted); on a GPU every proposal is a valid variant, the
    GEMV kernels come with the decode graphs, and split-KV attention is proposed for low concurrency
    (a batch of one sequence otherwise reads its context with one program per KV head) or long prompts."""
    import dataclasses

    from ops.search.agents import KernelChoices

    board = Board(tmp_path / "b.sqlite")
    state = _state(board, "k")
    assert KernelChoices().propose(state, 8) == []
    gpu = dataclasses.replace(state, device="cuda",
                              traffic=dataclasses.replace(state.traffic, estimated_concurrency=1.5))
    props = KernelChoices().propose(gpu, 8)
    for p in props:
        VariantSpec.from_json(p.variant.to_json())  # round-trips through validation
    split = [p.variant for p in props if p.variant.params("attention").get("num_splits") == 0]
    assert len(split) == 1
    assert split[0].impl("linear") == "triton" and split[0].cuda_graph_batch_sizes
    busy = dataclasses.replace(gpu, traffic=dataclasses.replace(gpu.traffic, estimated_concurrency=32.0))
    assert not any(p.variant.params("attention").get("num_splits") == 0 for p in KernelChoices().propose(busy, 8))
    long = dataclasses.replace(gpu, traffic=dataclasses.replace(gpu.traffic, input_p90=32000.0), max_input=None)
    long_split = [p.variant for p in KernelChoices().propose(long, 8) if p.variant.impl("attention") == "triton_split_kv"]
    assert len(long_split) == 1 and long_split[0].params("attention")["num_splits"] == 16  # sized to the context
    # the low-concurrency split-KV forms too: 32,000 tokens of context take 16 splits, not the automatic count
    assert {p.variant.params("attention").get("num_splits") for p in KernelChoices().propose(long, 8)} >= {16}
    assert not any(p.variant.params("attention").get("num_splits") == 0 for p in KernelChoices().propose(long, 8))
    assert not any(p.variant.impl("attention") == "triton_split_kv" for p in props)
    # programmatic dependent launch on Hopper and later only, for every kernel that takes it
    assert not any(p.variant.params("linear").get("pdl") for p in props)  # the test hardware has no capability
    hopper = dataclasses.replace(gpu, hardware=dataclasses.replace(gpu.hardware, compute_capability="9.0"))
    pdl = [p.variant for p in KernelChoices().propose(hopper, 8) if p.variant.params("linear").get("pdl")]
    assert len(pdl) == 2 and all(v.params(op).get("pdl") == 1 for v in pdl for op in PDL_OPS)
    assert all(v.params("attention")["num_splits"] == 0 for v in pdl)  # low concurrency: with split-KV
    # and a dense model at low concurrency: the attention block in one launch too
    assert [v.impl("rotary_attention") for v in pdl] == ["reference", "triton"]
    assert pdl[1].params("rotary_attention")["num_splits"] == 0
    assert not any(p.variant.impl("rotary_attention") == "triton" for p in KernelChoices().propose(
        dataclasses.replace(hopper, traffic=dataclasses.replace(gpu.traffic, estimated_concurrency=32.0)), 8))
    assert not any(p.variant.impl("prefetch") == "triton" for p in KernelChoices().propose(hopper, 8))  # dense
    moe = dataclasses.replace(hopper, model_spec=dataclasses.replace(hopper.model_spec, experts=128, experts_per_token=8,
                                                               hidden_size=2048))
    moe_forms = [p.variant for p in KernelChoices().propose(moe, 8) if p.variant.impl("prefetch") == "triton"]
    assert len(moe_forms) == 1 and moe_forms[0].params("moe")["decode_split_down"] == 2
    assert moe_forms[0].params("moe")["decode_block_k"] == moe_forms[0].params("linear")["block_k"] == 2048
    assert moe_forms[0].impl("rotary_attention") == "triton" and moe_forms[0].params("rotary_attention")["pdl"] == 2
    VariantSpec.from_json(moe_forms[0].to_json())
    ampere = dataclasses.replace(gpu, hardware=dataclasses.replace(gpu.hardware, compute_capability="8.0"))
    assert not any(p.variant.params("linear").get("pdl") for p in KernelChoices().propose(ampere, 8))


def test_kernel_templates_write_checked_kernels_and_mutate_the_best(tmp_path):
    """The offline producer of generated code: nothing on a CPU unless asked; every proposal passes the
    grammar; after a templated variant is measured, its mutations (tiles, loop order, fusion) follow it."""
    from engine.generated.grammar import check_kernel
    from ops.search.agents import KernelTemplates
    from ops.search.kernel_templates import choices_in

    board = Board(tmp_path / "b.sqlite")
    state = _state(board, "tpl")
    assert KernelTemplates().propose(state, 8) == []
    props = KernelTemplates(on_cpu=True).propose(state, 8)
    assert {c.op for p in props for c in choices_in(p.variant)} == {"rms_norm", "fused_add_rms_norm",
                                                                    "silu_and_mul", "linear", "act_linear"}
    for p in props:
        for c in choices_in(p.variant):
            check_kernel(c.op, c.module, c.op, dict(p.variant.generated_source)[c.module])
        VariantSpec.from_json(p.variant.to_json())
    lin = next(p.variant for p in props if any(c.op == "linear" for c in choices_in(p.variant)))
    board.enqueue("tpl", lin, "fast", "kernel-templates", "r")
    exp = board.claim("w", "tpl")
    rid = board.complete(exp, "w", {"output_tok_s": 10.0, "predicted": {"capacity": 3.0, "output_tok_s": 10.0}})
    state = _state(board, "tpl")
    muts = KernelTemplates(on_cpu=True).propose(state, 40)
    assert muts and all(p.refs == (rid,) for p in muts if "mutation" in p.rationale)
    tiles = [p for p in muts if "BLOCK_K 32 -> 64" in p.rationale]
    assert tiles and tiles[0].variant.params("linear")["BLOCK_K"] == 64
    assert any("matmul_dot -> matmul_rows" in p.rationale for p in muts)  # another loop order
    fused = [p.variant for p in muts if "act_linear fused" in p.rationale]
    assert fused and fused[0].impl("act_linear").startswith("generated:tpl_act_linear_")
    assert all(state.fresh(p.variant) for p in muts)
