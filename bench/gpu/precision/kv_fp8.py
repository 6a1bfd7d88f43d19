"""10. The FP8 (e4m3) KV cache on the 8B shape (random bf16 weights): its logits and greedy tokens against the
bf16 cache on a 4,000-token prompt, then batch decode at long context (prompts of 32,000 tokens), where a
step reads more cache than weights, and how many such sequences each cache holds in the same bytes. Capacity
at the SLO on the long-context slice is bench/tuning/capacity_ab.py's (a run of its own)."""
from __future__ import annotations

import dataclasses
import time
import traceback

import torch

from bench.gpu.harness import Llama8B, row, section
from engine.config.presets import preset_variant


def _greedy(eng, prompts, new):
    from engine import SamplingParams

    return [o.token_ids for o in eng.generate(prompts, SamplingParams(max_tokens=new, ignore_eos=True))]


def _batch_decode_tps(eng, prompts, new) -> tuple[float, float]:
    """(prefill seconds, decode tok/s of the whole batch) for ``prompts`` decoded together."""
    from engine import SamplingParams

    eng.block_manager.reset_prefix_cache()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for p in prompts:
        eng.add_request(p, SamplingParams(max_tokens=new, ignore_eos=True))
    while eng.scheduler.waiting or any(not s.output_token_ids for s in eng.scheduler.running):
        eng.step()
    torch.cuda.synchronize()
    prefill = time.perf_counter() - t
    left = sum(new - len(s.output_token_ids) for s in eng.scheduler.running)
    t = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    torch.cuda.synchronize()
    return prefill, left / (time.perf_counter() - t)


@section
def fp8_kv_cache(m: Llama8B, bw: float, length: int = 32000, batches=(1, 4), new: int = 64, splits: int = 16,
                 check: bool = True) -> None:
    from bench.gpu.precision.weights import _logits
    from engine import LLMEngine

    block = 16
    blocks = max(batches) * (length + new + block) // block + 8
    eng = LLMEngine(dataclasses.replace(m.config, num_kv_blocks=blocks), m.loaded)
    eng.config = dataclasses.replace(eng.config, async_decode=True)
    form = preset_variant("dense-decode", m.mcfg.hidden_size, base=eng.variant, cuda_graph_batch_sizes=tuple(batches),
                          max_num_seqs=max(batches), max_num_batched_tokens=8192)
    # 16 splits of each context: the automatic 4 at batch 1 (32 programs, sized for short contexts) read a
    # 32,000-token cache at a quarter of the roofline (measured 2026-12-02)
    params = {op: dict(p) for op, p in form.kernel_params}
    for op in ("attention", "rotary_attention"):
        params[op] = {**params.get(op, {}), "num_splits": splits}
    form = dataclasses.replace(form, kernel_params=params)
    # the FP8 cache twice: its tiles widened to bf16 (the kernels' default), and to float16 (``fp8_f16``)
    f16 = dataclasses.replace(form, kv_cache_dtype="fp8", kernel_params={
        op: {**p, "fp8_f16": 1} if op in ("attention", "rotary_attention") else p for op, p in params.items()})
    forms = {"auto": form, "fp8": dataclasses.replace(form, kv_cache_dtype="fp8"), "fp8-f16": f16}
    labels = {"auto": "bf16", "fp8": "FP8", "fp8-f16": "FP8 widened to f16"}
    gen = torch.Generator().manual_seed(0)
    short = torch.randint(0, 128000, (4000,), generator=gen).tolist()
    logits, tokens = {}, {}
    for kind in forms if check else ():
        try:
            eng.apply_variant(forms[kind])
            eng.block_manager.reset_prefix_cache()
            logits[kind] = _logits(eng, short)
            eng.block_manager.reset_prefix_cache()
            tokens[kind] = _greedy(eng, [short], 32)[0]
        except Exception as e:
            traceback.print_exc()
            row(f"8B, {kind} KV cache, 4,000-token prompt", f"FAILED {type(e).__name__}: {str(e)[:200]}")
            return
    for kind in [k for k in forms if k != "auto"] if check else ():
        ref, got = logits["auto"], logits[kind]
        kl = torch.nn.functional.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                        reduction="sum").item()
        same = next((i for i, (a, b) in enumerate(zip(tokens["auto"], tokens[kind])) if a != b), len(tokens["auto"]))
        row(f"8B, {labels[kind]} KV cache against bf16, 4,000-token prompt",
            f"last-position logits max |d| {(got - ref).abs().max().item():.3g} (max |logit| {ref.abs().max():.2f}), "
            f"KL {kl:.3g}; greedy tokens equal for the first {same} of 32")
    per_token = m.mcfg.kv_bytes_per_token(2)
    long_prompts = [torch.randint(0, 128000, (length,), generator=gen).tolist() for _ in range(max(batches))]
    dense = sum(p.numel() * p.element_size() for p in m.loaded.model.parameters()) - m.embed_bytes
    results = {}
    for b in batches:
        for kind in forms:
            try:
                eng.apply_variant(forms[kind])
                _batch_decode_tps(eng, long_prompts[:b], 8)  # compiles the shapes of this batch
                prefill, tps = _batch_decode_tps(eng, long_prompts[:b], new)
            except Exception as e:
                traceback.print_exc()
                row(f"8B decode b={b} at {length} tokens, {kind} KV", f"FAILED {type(e).__name__}: {str(e)[:200]}")
                continue
            kv = b * (length + new / 2) * per_token * (1.0 if kind == "auto" else 0.5)
            roofline = b * bw / (dense + kv)
            results[(b, kind)] = tps
            label = labels[kind]
            row(f"8B decode b={b}, prompts of {length:,} tokens, {splits} splits, {label} KV cache ({kv / 1e9:.1f} GB of cache a step)",
                f"{tps:.1f} tok/s = {100 * tps / roofline:.1f}% of its roofline ({roofline:.0f})"
                + (f"; {tps / results[(b, 'auto')]:.2f}x the bf16 cache" if (b, "auto") in results and kind != "auto"
                   else "") + f"; prefill {prefill:.1f} s")
    free = torch.cuda.mem_get_info()[0] + eng.kv.pool.numel() * eng.kv.pool.element_size()
    row("long-context sequences of 32,000 tokens that fit the free memory",
        f"bf16 cache {free / (length * per_token):.0f}, FP8 cache {free / (length * per_token / 2):.0f} "
        f"({free / 1e9:.0f} GB free with the weights resident)")
    del eng
    torch.cuda.empty_cache()
