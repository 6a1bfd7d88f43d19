"""Variants: identity and scopes, hot swap mid-generation, refusal of broken generated source."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.errors import ConfigError, VariantError
from engine.generated.grammar import check_kernel
from engine.config.source import ModelSource
from engine.config.presets import TRITON_ALL, TRITON_GEMV, with_pdl
from engine.config.variant import REFERENCE_VARIANT, VariantSpec

TINY = Path(__file__).parent / "tiny_moe" / "config.json"

GOOD_SILU = """import triton
import triton.language as tl


@triton.jit
def silu_and_mul(x_ptr, out_ptr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    g = tl.load(x_ptr + row * 2 * D + cols, mask=cols < D, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * 2 * D + D + cols, mask=cols < D, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + cols, g * tl.sigmoid(g) * u, mask=cols < D)
"""
ALL_TRITON = {**TRITON_ALL, **TRITON_GEMV, "norm_moe": "triton", "prefetch": "triton", "rotary_attention": "triton"}


def test_variant_id_is_content_hashed_and_round_trips():
    a = VariantSpec(name="a", block_size=32, kernels={"attention": "triton_split_kv"},
                    kernel_params={"attention": {"num_splits": 4, "block_n": 64}})
    b = VariantSpec(name="b", kernel_params={"attention": {"block_n": 64, "num_splits": 4}},
                    kernels={"attention": "triton_split_kv"}, block_size=32)
    assert a.variant_id == b.variant_id  # the label and the order of entries do not matter
    assert VariantSpec(block_size=16).variant_id != a.variant_id
    back = VariantSpec.from_json(json.loads(json.dumps(a.to_json())))
    assert back == a and back.variant_id == a.variant_id
    with pytest.raises(ConfigError, match="does not match"):
        VariantSpec.from_json({**a.to_json(), "variant_id": "0" * 16})
    with pytest.raises(ConfigError, match="unknown variant fields"):
        VariantSpec.from_json({"blok_size": 8})
    with pytest.raises(ConfigError, match="unknown implementation"):
        VariantSpec(kernels={"attention": "cuda_magic"})
    with pytest.raises(ConfigError, match="positive integer"):
        VariantSpec(block_size=0)


def test_every_field_has_a_scope():
    import dataclasses

    scopes = {f.name: f.metadata.get("scope") for f in dataclasses.fields(VariantSpec)}
    assert scopes["name"] is None
    assert {k for k, v in scopes.items() if v is None} == {"name"}
    assert scopes["block_size"] == "kv_layout" and scopes["max_num_seqs"] == "scheduler"
    assert scopes["kernels"] == "forward" and scopes["tp"] == "parallel"
    assert VariantSpec(block_size=8).changed_scopes(VariantSpec()) == {"kv_layout"}
    assert VariantSpec(kernels={"rotary": "triton"}, max_num_seqs=3).changed_scopes(VariantSpec()) == {
        "forward", "scheduler"}


def _tiny(variant=None, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(source=ModelSource("synthetic", TINY, seed=1), num_kv_blocks=64, load_tokenizer=False,
                                  variant=variant or VariantSpec(block_size=4), **kw))


@pytest.mark.slow
def test_all_triton_variant_equals_reference_on_a_tiny_model():
    prompts = [[1, 5, 9, 13, 2, 7, 33], [4, 4, 8], list(range(10, 23))]  # partial blocks, several blocks
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    ref = [o.token_ids for o in _tiny().generate(prompts, params)]
    # the attention block in one launch (rotary_attention: its decode splits chosen by the batch, merged after),
    # then composed of the Triton rotary + KV store and split-KV attention (the "attention" kernel runs only
    # there), every kernel with pdl
    fused = VariantSpec(block_size=4, kernels=ALL_TRITON, kernel_params={"rotary_attention": {"block_n": 8}})
    composed = VariantSpec(block_size=4, kernels={**ALL_TRITON, "attention": "triton_split_kv",
                                                  "rotary_attention": "reference"},
                           kernel_params=with_pdl({"attention": {"block_n": 8}}))
    for spec in (fused, composed):
        assert [o.token_ids for o in _tiny(spec).generate(prompts, params)] == ref, spec.kernels["rotary_attention"]
    # the MoE forms below, with the attention block in one launch and one split (the splits are the run above's;
    # interpreted, each split of each sequence and KV head is a program)
    one_split = {"rotary_attention": {"block_n": 8, "num_splits": 1}}
    # the experts in one launch that routes for itself, after the composed or the fused norm + router
    one = {"decode_split_down": 3, "decode_chunk": 12, "decode_block_k": 32, "decode_down_block_n": 16}
    for norm_moe in ("reference", "triton"):
        spec = VariantSpec(block_size=4, kernels={**ALL_TRITON, "norm_moe": norm_moe},
                           kernel_params=with_pdl({**one_split, "moe": one, "norm_moe": one}))
        assert [o.token_ids for o in _tiny(spec).generate(prompts, params)] == ref, norm_moe
    # the routing by rank, the weights "evict first" (experts and projections), the activation applied by the
    # gate/up kernel, the next layer's QKV projection read ahead with the join deferred (a hint: nothing on a CPU)
    own = {"decode_split_down": 2, "decode_route_rank": 1, "decode_evict": 1, "decode_block_k": 32, "decode_act": 1}
    for norm_moe in ("reference", "triton"):
        spec = VariantSpec(block_size=4, kernels={**ALL_TRITON, "norm_moe": norm_moe},
                           kernel_params=with_pdl({**one_split, "moe": own, "norm_moe": own,
                                                   "linear": {"evict": 1}, "norm_linear": {"evict": 1},
                                                   "act_linear": {"evict": 1},
                                                   "prefetch": {"next_qkv": 1, "defer_join": 1}}, 2))
        assert [o.token_ids for o in _tiny(spec).generate(prompts, params)] == ref, norm_moe
    # each Triton kernel alone among the references: a prefill and one decode step each (the kernels' own
    # tests check them on random inputs of many shapes; this checks each one's place in the forward pass)
    two = SamplingParams(max_tokens=2, ignore_eos=True)
    for op in ("rotary", "store_kv", "rotary_store_kv", "norm_rotary_store_kv", "rotary_attention", "moe", "linear",
               "norm_linear", "act_linear", "norm_moe", "prefetch"):
        spec = VariantSpec(block_size=4, kernels={op: ALL_TRITON[op]})
        assert [o.token_ids for o in _tiny(spec).generate(prompts, two)] == [r[:2] for r in ref], op


def _weights(engine):
    return {n: (p.data_ptr(), p._version) for n, p in engine.model.named_parameters()}


@pytest.mark.slow
def test_hot_swaps_mid_generation_match_the_reference(smollm2_engine_factory):
    prompts = ["The capital of France is", "def add(a, b):", "List three colors:", "Water is made of"]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    # the first 8 layers (the swaps do not depend on depth; the generated kernel runs interpreted in each layer)
    ref_engine = smollm2_engine_factory(short=True, num_kv_blocks=128)
    alone = [ref_engine.generate([p], params)[0].token_ids for p in prompts]

    eng = smollm2_engine_factory(short=True, num_kv_blocks=128, async_decode=True)  # swaps also drain a step run ahead
    weights = _weights(eng)
    rids = [eng.add_request(p, params) for p in prompts]
    out = {}

    def run(steps):
        for _ in range(steps):
            out.update({o.request_id: o.token_ids for o in eng.step() if o.finished})

    run(3)
    base = eng.variant
    kv = eng.apply_variant(VariantSpec(**{**_knobs(base), "block_size": 8}))  # kv_layout: pool rebuilt
    assert kv.scopes == ["kv_layout"] and eng.kv.block_size == 8
    run(3)
    fwd_spec = VariantSpec(**{**_knobs(base), "block_size": 8},
                           kernels={"rms_norm": "triton", "silu_and_mul": "generated:gen_act.silu_and_mul"},
                           kernel_params={"silu_and_mul": {"BLOCK_D": 1024}}, generated_source={"gen_act": GOOD_SILU})
    fwd = eng.apply_variant(fwd_spec)
    assert fwd.scopes == ["forward"] and eng.variant.variant_id == fwd_spec.variant_id
    run(2)
    sch = eng.apply_variant(dataclasses.replace(fwd_spec, max_num_batched_tokens=64, max_num_seqs=2))
    assert sch.scopes == ["scheduler"] and eng.scheduler.config.max_num_seqs == 2
    run(2)
    eng.rollback()  # back to the forward variant's knobs, live
    assert eng.variant == fwd_spec and eng.scheduler.config.max_num_seqs == base.max_num_seqs
    while eng.has_unfinished():
        run(1)
    assert [out[r] for r in rids] == alone
    assert _weights(eng) == weights  # no swap touched or reallocated a weight


def test_parallel_change_is_refused_and_nothing_changes():
    eng = _tiny()
    before = eng.variant
    with pytest.raises(VariantError, match="restart"):
        eng.apply_variant(VariantSpec(**{**_knobs(before), "tp": 2}))
    assert eng.variant == before


BAD_PARAMS = {
    "activation with the one-launch experts": ({"moe": {"decode_act": 1, "decode_split_down": 3}}, "decode_act needs"),
    "switch out of range": ({"moe": {"decode_act": 2}}, "decode_act must be one of 0, 1"),
    "tile not a power of two": ({"norm_moe": {"decode_block_n": 3}}, "power of two"),
    "misspelled moe parameter": ({"moe": {"decode_actt": 1}}, "unknown moe parameters decode_actt"),
    "prefetch site out of range": ({"prefetch": {"next_qkv": 3}}, "next_qkv must be one of 0, 1, 2"),
    "prefetch switch as text": ({"prefetch": {"defer_join": "1"}}, "defer_join must be one of 0, 1"),
    "misspelled prefetch parameter": ({"prefetch": {"defer": 1}}, "unknown parameters defer"),
    "misspelled attention parameter": ({"attention": {"blok_n": 8}}, "unknown parameters blok_n"),
}


@pytest.mark.parametrize("case", list(BAD_PARAMS))
def test_bad_kernel_params_are_refused_when_built_and_engine_keeps_serving(case):
    """A kernel's parameters are checked when the variant's table is built (not in its first forward pass):
    VariantError names the bad one and the active variant goes on serving."""
    kernel_params, reason = BAD_PARAMS[case]
    eng = _tiny()
    before_ops, before = eng.ops, eng.variant
    rid = eng.add_request([3, 1, 4, 1, 5], SamplingParams(max_tokens=4, ignore_eos=True))
    eng.step()
    spec = VariantSpec(**_knobs(before), kernels={"moe": "triton", "norm_moe": "triton", "prefetch": "triton",
                                                  "attention": "triton_paged"}, kernel_params=kernel_params)
    with pytest.raises(VariantError, match=reason):
        eng.apply_variant(spec)
    assert eng.variant == before and eng.ops is before_ops
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
    assert len(done[rid]) == 4


_SIG = "def silu_and_mul(x_ptr, out_ptr, D: tl.constexpr, BLOCK_D: tl.constexpr):\n"
_HEAD = "import triton\nimport triton.language as tl\n\n@triton.jit\n"
BROKEN = {
    "syntax error": ("def silu_and_mul(x):\n    return x[:, :\n", "not valid Python"),
    "forbidden import": ("import os\n" + _HEAD + _SIG + "    pass\n", "import 'os' is not allowed"),
    "forbidden builtin": (_HEAD + _SIG + "    y = eval(D)\n", "call of 'eval' is not allowed"),
    "file access through torch": ("import torch\n" + _HEAD + _SIG + "    pass\n", "import 'torch' is not allowed"),
    "dunder escape": (_HEAD + _SIG + "    y = D.__class__\n", "attribute 'D.__class__' is not allowed"),
    "wrong result": (GOOD_SILU.replace("g * tl.sigmoid(g) * u", "g * u"), "differs from the reference"),
    "exception at run time": (GOOD_SILU.replace("tl.arange(0, BLOCK_D)", "tl.arange(0, 3)"), "raised on case 0"),
    "missing function": (_HEAD + _SIG.replace("silu_and_mul", "something_else") + "    pass\n", "is named"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_generated_source_is_refused_and_engine_keeps_serving(case):
    text, reason = BROKEN[case]
    eng = _tiny()
    before_ops, before = eng.ops, eng.variant
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    rid = eng.add_request([3, 1, 4, 1, 5], params)
    eng.step()
    spec = VariantSpec(**_knobs(before), kernels={"silu_and_mul": "generated:bad.silu_and_mul"},
                       generated_source={"bad": text})
    with pytest.raises(VariantError, match=reason.replace("(", r"\(")):
        eng.apply_variant(spec)
    assert eng.variant == before and eng.ops is before_ops
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
    assert done[rid] == _tiny().generate([[3, 1, 4, 1, 5]], params)[0].token_ids


def test_generated_source_lands_on_a_content_addressed_path(tmp_path, monkeypatch):
    from engine.generated.source import materialize

    monkeypatch.setenv("POLYINF_CACHE", str(tmp_path))
    p1 = materialize("gen_act", GOOD_SILU)
    p2 = materialize("gen_act", GOOD_SILU)
    p3 = materialize("gen_act", GOOD_SILU + "\n# changed\n")
    assert p1 == p2 != p3 and p1.read_text() == GOOD_SILU
    check_kernel("silu_and_mul", "gen_act", "silu_and_mul", GOOD_SILU)  # the good module passes the grammar


def test_a_passed_smoke_run_is_kept_for_the_process_and_a_failed_one_is_not(tmp_path, monkeypatch):
    """The gates build a dozen engines of one variant: its kernel goes to a child once per file, tiles and shapes."""
    import engine.generated.source as gs

    monkeypatch.setenv("POLYINF_CACHE", str(tmp_path))
    runs = []

    def child(op, path, function, params, dims, device):
        runs.append(params["BLOCK_D"])
        if params["BLOCK_D"] == 32:
            raise VariantError("failed in a child process")
    monkeypatch.setattr(gs, "smoke_in_child", child)
    for _ in range(2):
        gs.prepare_generated("silu_and_mul", "gen_act", "silu_and_mul", GOOD_SILU, {"BLOCK_D": 64})
    gs.prepare_generated("silu_and_mul", "gen_act", "silu_and_mul", GOOD_SILU, {"BLOCK_D": 64}, {"D": 48})
    for _ in range(2):
        with pytest.raises(VariantError, match="child"):
            gs.prepare_generated("silu_and_mul", "gen_act", "silu_and_mul", GOOD_SILU, {"BLOCK_D": 32})
    assert runs == [64, 64, 32, 32]  # other shapes: run again; a failure: run again


def _knobs(spec: VariantSpec) -> dict:
    return dict(max_num_seqs=spec.max_num_seqs, max_num_batched_tokens=spec.max_num_batched_tokens,
                prefill_chunk_size=spec.prefill_chunk_size, block_size=spec.block_size,
                enable_prefix_caching=spec.enable_prefix_caching)


def test_graph_modes_are_skipped_with_a_note_on_cpu():
    eng = _tiny()
    report = eng.apply_variant(VariantSpec(**_knobs(eng.variant), cuda_graph_batch_sizes=(1, 2, 4),
                                           compile_mode="default"))
    assert any("skipped on cpu" in n for n in report.notes)  # the swap's report says so, and the engine keeps it
    assert all(n in eng.notes for n in report.notes)


def test_prepare_reads_a_context_and_changes_nothing_until_the_commit():
    from engine.core import variant_swap

    eng = _tiny()
    before = (eng.variant, eng.ops, eng.runner.forward_fn, eng.runner.graphs, eng.kv, list(eng.notes))
    spec = VariantSpec(**_knobs(eng.variant), compile_mode="default", cuda_graph_batch_sizes=(1,))
    ctx = variant_swap.context(eng)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.ops = None
    prepared = variant_swap.prepare(ctx, spec)
    assert (eng.variant, eng.ops, eng.runner.forward_fn, eng.runner.graphs, eng.kv, eng.notes) == before
    assert prepared.ops is not eng.ops and any("skipped on cpu" in n for n in prepared.notes)
    report = eng.apply_variant(spec, prepared)
    assert eng.variant == spec and eng.ops is prepared.ops and report.notes == prepared.notes


def test_cli_variants_show_and_generate_with_a_variant_file(tmp_path, capsys):
    """The generate with a variant file as a process of its own (the real entry point); the others through the
    CLI's main() here."""
    import subprocess
    import sys

    from pipelines.cli import main

    def cli(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        rc = main(list(args))
        out = capsys.readouterr()
        return rc, out.out, out.err

    rc, out, _ = cli("variants", "show")
    assert rc == 0 and json.loads(out)["variant_id"] == REFERENCE_VARIANT.variant_id
    spec = VariantSpec(block_size=4, kernels={"silu_and_mul": "triton", "attention": "triton_paged"})
    path = tmp_path / "v.json"
    path.write_text(json.dumps(spec.to_json()))
    args = ["generate", "--model", str(TINY.parent), "--synthetic", "--seed", "1", "--prompt", "3 1 4 1 5",
            "--max-tokens", "4", "--ignore-eos", "--json"]
    with_variant = subprocess.run([sys.executable, "-m", "pipelines.cli", *args, "--variant", str(path)],
                                  capture_output=True, text=True)
    assert with_variant.returncode == 0, with_variant.stderr
    rc, plain, _ = cli(*args)
    assert rc == 0
    a, b = json.loads(with_variant.stdout), json.loads(plain)
    assert a["variant_id"] == spec.variant_id and b["variant_id"] != spec.variant_id
    assert a["token_ids"] == b["token_ids"] and len(a["token_ids"]) == 4
    path.write_text("{not json")
    rc, _, err = cli(*args, "--variant", str(path))
    assert rc == 2 and "not valid JSON" in err and "Traceback" not in err


def test_forward_swap_drops_the_prefix_cache():
    """KV cached under the previous kernels is not reused by the new ones."""
    eng = _tiny()
    prompt = list(range(1, 30))
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    eng.generate([prompt], params)
    assert eng.generate([prompt], params)[0].num_cached_tokens > 0
    eng.apply_variant(dataclasses.replace(eng.variant, kernels={"silu_and_mul": "triton"}))
    assert eng.generate([prompt], params)[0].num_cached_tokens == 0
    assert eng.generate([prompt], params)[0].num_cached_tokens > 0  # and caching resumes under the new kernels


def test_swap_is_prepared_while_another_thread_serves():
    import threading
    import time

    prompts = [[1, 5, 9, 13, 2, 7, 33], [4, 4, 8], list(range(10, 31))]
    # the swap is ready about ten steps in; the steps after it run the interpreted kernels
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ref = [o.token_ids for o in _tiny().generate(prompts, params)]
    eng = _tiny()
    rids = [eng.add_request(p, params) for p in prompts]
    out: dict = {}

    def serve():
        while eng.has_unfinished():
            out.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
            time.sleep(0.01)  # leave the GIL to the preparing thread

    eng.step()
    server = threading.Thread(target=serve)
    server.start()
    spec = dataclasses.replace(eng.variant, kernels={"rms_norm": "triton", "silu_and_mul": "triton"})
    report = eng.swap_variant(spec)
    in_flight = eng.has_unfinished()
    server.join()
    assert report.scopes == ["forward"] and eng.variant == spec
    assert in_flight, "the requests finished before the swap: the test did not swap mid-generation"
    assert [out[r] for r in rids] == ref


def _without_room_for_two_pools(monkeypatch, eng, refuse=lambda block_size: False):
    """KV pools that, like a GPU cache sized to the device's memory, cannot be allocated while the engine's pool
    exists (and, with ``refuse``, not at all for some block sizes)."""
    import engine.core.variant_swap as variant_swap

    real = variant_swap.KVCache

    class FullMemory(real):
        def __init__(self, cfg, num_blocks, block_size, device, dtype):
            if eng.kv.pool is not None or refuse(block_size):
                raise torch.OutOfMemoryError(f"no room for {num_blocks} more blocks")
            super().__init__(cfg, num_blocks, block_size, device, dtype)

    monkeypatch.setattr(variant_swap, "KVCache", FullMemory)


@pytest.mark.parametrize("outcome", ["swapped", "no room at all", "prepare fails after the release"])
def test_a_kv_swap_without_room_for_both_pools_releases_the_old_one(monkeypatch, outcome):
    """A KV-layout swap on a cache that fills the memory: the old pool goes first, the new one takes its place,
    running requests are recomputed and finish as they would alone; when the new one cannot be made (or the
    variant fails after the release) the old pool comes back and the engine serves on, unchanged."""
    prompts = [[5, 9, 13, 2, 7], [3, 3, 8, 1, 4, 6, 2], [11, 12]]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    ref = _tiny()
    alone = [ref.generate([p], params)[0].token_ids for p in prompts]
    eng = _tiny()
    base = eng.variant
    rids = [eng.add_request(p, params) for p in prompts]
    out = {}
    for _ in range(3):
        out.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
    target = VariantSpec(**{**_knobs(base), "block_size": 8})
    if outcome == "prepare fails after the release":
        target = dataclasses.replace(target, kernels={"attention": "triton_paged"},
                                     kernel_params={"attention": {"blok_n": 8}})
    _without_room_for_two_pools(monkeypatch, eng, refuse=lambda bs: outcome == "no room at all" and bs == 8)
    old_pool = eng.kv
    if outcome == "swapped":
        report = eng.apply_variant(target)
        assert report.scopes == ["kv_layout"] and eng.kv.block_size == 8 and eng.variant == target
        assert eng.kv.num_blocks == 32  # the same memory under the new block size
    else:
        with pytest.raises(VariantError, match="no room|blok_n"):
            eng.apply_variant(target)
        assert eng.variant == base and eng.kv.block_size == 4 and eng.kv.num_blocks == 64
        assert eng.kv.pool is not None and eng.runner.kv is eng.kv
        assert eng.kv is not old_pool  # released, then allocated again
    while eng.has_unfinished():
        out.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
    assert [out[r] for r in rids] == alone


def test_quantized_variant_takes_the_triton_projections_with_pinned_tiles_on_a_gpu_only():
    from engine.config.presets import PDL_OPS, QUANTIZED_MMA, QUANTIZED_PDL, QUANTIZED_TILES, quantized_variant

    base = VariantSpec(name="sb", kernels={"attention": "triton_paged", "act_linear": "triton"},
                       kernel_params={"attention": {"block_n": 128}, "linear": {"pdl": 1},
                                      "act_linear": {"block_n": 16}}, max_num_seqs=32)
    gpu = quantized_variant(base, "fp8", "cuda")
    kernels, params = dict(gpu.kernels), {op: dict(p) for op, p in gpu.kernel_params}
    assert gpu.weight_dtype == "fp8" and gpu.name == "sb + fp8 weights" and gpu.max_num_seqs == 32
    assert gpu.fp8_accumulation == "fast"  # the W8A8 GEMM's sums in the tensor cores' accumulator
    assert kernels["linear"] == kernels["norm_linear"] == "triton" and kernels["attention"] == "triton_paged"
    # a chosen form keeps its tiles; every Triton projection takes the tensor-core kernel from one row, at one row
    # only on weights of 64 Mi elements and more (FP8) or 32 Mi (int8)
    mma = QUANTIZED_MMA["fp8"]
    assert mma == {"mma": 1, "mma_min_numel": 64 << 20}
    # every kernel that takes it with dependent launch at QUANTIZED_PDL (2), over the base's own level
    pdl = {"pdl": QUANTIZED_PDL}
    assert QUANTIZED_PDL == 2
    assert kernels["act_linear"] == "triton" and params["act_linear"] == {"block_n": 16, **mma, **pdl}
    assert params["linear"] == {**QUANTIZED_TILES, **mma, **pdl}
    assert params["norm_linear"] == {**QUANTIZED_TILES, **mma, **pdl}
    assert params["attention"] == {"block_n": 128, **pdl}
    assert all(params[op] == pdl for op in PDL_OPS if op not in ("linear", "norm_linear", "act_linear", "attention"))
    int8 = {op: dict(p) for op, p in quantized_variant(base, "int8", "cuda").kernel_params}
    assert int8["act_linear"] == {"block_n": 16, "mma": 1, "mma_min_numel": 32 << 20, **pdl}
    cpu = quantized_variant(base, "int8", "cpu", name="q")
    assert (cpu.name, cpu.weight_dtype, cpu.kernels, cpu.kernel_params) == ("q", "int8", base.kernels,
                                                                           base.kernel_params)
    assert quantized_variant(base, "int8", "cuda").fp8_accumulation == "float32"
    assert quantized_variant(base, "fp8", "cpu").fp8_accumulation == "float32"  # a CPU has one accumulation
    with pytest.raises(ConfigError, match="int8 or fp8, not 'int4'"):
        quantized_variant(base, "int4", "cuda")


def test_graphs_alone_gives_the_baseline_the_candidates_prefill_graphs_and_dependent_launch_and_nothing_else():
    from engine.config.presets import graphs_alone, prefill_graphed, quantized_variant, with_pdl

    base = VariantSpec(name="static-best", kernels={"attention": "triton_paged"}, max_num_seqs=32,
                       max_num_batched_tokens=2048, prefill_chunk_size=512)
    quant = prefill_graphed(quantized_variant(base, "fp8", "cuda"))
    arm = graphs_alone(base, quant)
    # the candidate's dependent launch (QUANTIZED_PDL) too, at level 1, on every kernel that takes it
    assert arm.name == "static-best, prefill graphs, pdl 1" and arm.weight_dtype == "auto" and arm.kernels == base.kernels
    assert arm.prefill_graph_tokens == quant.prefill_graph_tokens == (128, 256, 512, 1024, 2048)
    assert arm.prefill_chunk_size == 2048 and arm.changed_scopes(base) == {"scheduler", "forward"}
    assert {op: dict(p) for op, p in arm.kernel_params} == with_pdl({}, 1)
    assert graphs_alone(base, quantized_variant(base, "fp8", "cuda")) is None  # the candidate has no graphs
    assert graphs_alone(prefill_graphed(base), quant) is None  # the baseline has its own
    # a candidate without dependent launch, or a baseline with its own: the graphs alone
    plain = dataclasses.replace(quant, kernel_params={})
    assert graphs_alone(base, plain).name == "static-best, prefill graphs"
    assert graphs_alone(base, plain).kernel_params == base.kernel_params
    own = dataclasses.replace(base, kernel_params={"attention": {"pdl": 2}})
    assert dict(graphs_alone(own, quant).kernel_params) == {"attention": (("pdl", 2),)}


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantized_projections_on_the_tensor_core_kernel_answer_like_the_reference(kind):
    """Quantized weights with the linear operations' rows on kernels/linear/qmma_triton.py (prefill and decode rows
    both at most 64) against the plain-torch quantized path: the same tokens, and the log-probabilities of the
    most likely ones within the activations' quantization (int8: 7 bits, e4m3: 3)."""
    prompts = [[1, 5, 9, 13, 2, 7, 33], [4, 4, 8]]
    params = SamplingParams(max_tokens=2, ignore_eos=True, logprobs=5)
    ref = _tiny(VariantSpec(block_size=4, weight_dtype=kind)).generate(prompts, params)
    mma = {"mma": 1, "mma_block_n": 32, "mma_block_k": 64, "mma_warps": 4, "mma_stages": 2}
    spec = VariantSpec(block_size=4, weight_dtype=kind, kernels=dict(TRITON_GEMV),
                       kernel_params={op: mma for op in TRITON_GEMV})
    got = _tiny(spec).generate(prompts, params)
    worst = 0.0
    for a, b in zip(got, ref):
        assert a.token_ids[0] == b.token_ids[0]  # e4m3 may swap near ties after that: the log-probabilities decide
        for (_, _, top_a), (_, _, top_b) in zip(a.logprobs, b.logprobs):
            want = dict(top_b)
            worst = max(worst, max(abs(lp - want[t]) for t, lp in top_a if t in want))
    assert worst <= (0.02 if kind == "int8" else 0.1)
