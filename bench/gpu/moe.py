"""7. The Qwen3-30B-A3B-shaped MoE (random bf16 weights): batch-1 decode against the active-parameter
roofline, the MoE decode preset and its variations, each form's greedy tokens checked against the eager
reference MoE kernels; where a step goes, kernel by kernel."""
from __future__ import annotations

import dataclasses
import time
import traceback

import torch

from bench.gpu.experts import experts_sweep, one_launch_sweep
from bench.gpu.harness import decode_tps, kernel_profile, row, section, timed
from engine.config.presets import TRITON_ALL, preset, preset_variant, with_pdl


@section
def moe_decode(bw: float, layers: int | None, sweep_tiles: bool = False):
    from engine import EngineConfig, LLMEngine, SamplingParams, resolve

    # the previous best form (no dependent launch): the block after attention composed of its parts (norm,
    # router GEMV, routing, experts, sum: five launches)
    spec = preset_variant("gemv-split-kv", cuda_graph_batch_sizes=(1, 2, 4))
    t = time.perf_counter()
    eng = LLMEngine(EngineConfig(source=resolve("qwen3-30b-a3b"), device="cuda", dtype="bfloat16",
                                 num_kv_blocks=256, load_tokenizer=False, layers=layers, variant=spec))
    build = time.perf_counter() - t
    cfg = eng.model_config
    total = sum(p.numel() * p.element_size() for p in eng.model.parameters())
    experts = sum(p.numel() * p.element_size() for n, p in eng.model.named_parameters() if n.endswith(("w13", "w2")))
    embed = eng.model.embed_tokens.weight.numel() * 2
    active = total - experts - embed + experts * cfg.num_experts_per_tok // cfg.num_experts
    prompt, new = list(range(1, 129)), 128
    kv = cfg.kv_bytes_per_token(2) * (len(prompt) + new / 2)
    roofline = bw / (active + kv)
    row(f"MoE ({cfg.num_hidden_layers} layers) weights, active bytes per token",
        f"{total / 1e9:.1f} GB total, {active / 1e9:.2f} GB active (8 of 128 experts, lm_head; not the embedding "
        f"table); roofline {roofline:.0f} tok/s; engine build {build:.0f} s")
    # correctness on the GPU first: every form's greedy tokens against the eager reference MoE kernels
    ref_eng = LLMEngine.with_loaded(eng, dataclasses.replace(eng.config, variant=dataclasses.replace(
        spec, kernels={**TRITON_ALL, "moe": "reference"}, cuda_graph_batch_sizes=())))
    want = ref_eng.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    del ref_eng
    # the MoE decode preset, and the same with changes (moe, prefetch, rotary_attention parameters)
    decode = preset_variant("moe-decode", cfg.hidden_size, base=spec)
    params = preset("moe-decode").params(cfg.hidden_size)

    def moe_with(moe=None, prefetch=None, attention=None):
        return dataclasses.replace(decode, kernel_params={
            **params, "moe": {**params["moe"], **(moe or {})}, "prefetch": {**params["prefetch"], **(prefetch or {})},
            "rotary_attention": {**params["rotary_attention"], **(attention or {})}})

    forms = [
        ("TRITON_MOE_DECODE (the next QKV and o_proj into L2 during the attention, joined at the step's end; "
         "the activation in gate/up) (moe-decode)", decode),
        ("the previous TRITON_MOE_DECODE (o_proj's join before it, the activation in down)",
         moe_with({"decode_act": 0, "decode_block_n": 4}, {"defer_join": 0, "next_qkv": 0})),
        ("+ the activation in gate/up with 1 + 1 rows per program", moe_with({"decode_block_n": 1})),
    ]
    if sweep_tiles:  # the experts in one launch (measured slower than three launches: bench/RESULTS.md)
        one = one_launch_sweep(eng, cfg, params)
        if one:
            forms.append(("+ the experts in one launch (routing, gate/up, down, sum)", dataclasses.replace(
                decode, kernel_params={**params, "moe": {**one, "pdl": 2}})))
        forms += experts_sweep(eng, cfg, decode, params)
    best = (0.0, None, "")
    for name, variant in forms:
        try:
            eng.apply_variant(variant)
            eng.block_manager.reset_prefix_cache()
            got = eng.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
            agree = sum(a == b for a, b in zip(got, want))
            tps = max(decode_tps(eng, prompt, new) for _ in range(3))
            graph, _ = eng.runner.graphs.graphs[1]
            replay = timed(graph.replay, iters=30)
        except Exception as e:  # report the form and go on with the next
            traceback.print_exc()
            row(f"MoE decode b=1 [{name}]", f"FAILED {type(e).__name__}: {str(e)[:160]}")
            continue
        row(f"MoE decode b=1 [{name}] (greedy vs eager reference MoE {agree}/8)",
            f"{tps:.1f} tok/s = {100 * tps / roofline:.1f}% of the active roofline; graph replay alone "
            f"{1 / replay:.1f} tok/s = {100 / replay / roofline:.1f}%")
        if agree == 8 and tps > best[0]:
            best = (tps, variant, name)
    row(f"MoE best decode b=1: [{best[2]}]", f"{best[0]:.1f} tok/s = {100 * best[0] / roofline:.1f}% of the "
        "active roofline")
    # where a step goes, kernel by kernel, in the best form without dependent launch (with it kernels overlap and
    # the profiler's per-kernel times add up to more than the step)
    if best[1] is not None:
        eng.apply_variant(dataclasses.replace(best[1], kernel_params=with_pdl(best[1].kernel_params, 0)))
        eng.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))
        kernel_profile("MoE, best form without dependent launch, graph replay", eng.runner.graphs.graphs[1][0].replay)
    del eng
    torch.cuda.empty_cache()
