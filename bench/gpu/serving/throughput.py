"""5. The 8B model: offline throughput on the Azure conversation trace's request lengths against
transformers' eager batched generate; prefill MFU."""
from __future__ import annotations

import csv
import dataclasses
import time
from pathlib import Path

import torch

from bench.gpu.harness import DATASHEET_BF16, Llama8B, row, section
from engine.config.presets import preset_variant


def trace_requests(path: Path, n: int, max_in: int, max_out: int) -> list[tuple[int, int]]:
    with open(path) as f:
        rows = list(csv.DictReader(f))[:n]
    return [(min(int(r["ContextTokens"]), max_in), max(1, min(int(r["GeneratedTokens"]), max_out))) for r in rows]


@section
def llama8b_throughput(m: Llama8B, trace: Path, peak: float, n: int, hf_batch: int):
    from engine import LLMEngine, SamplingParams

    reqs = trace_requests(trace, n, 2048, 256)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128000, (i,), generator=gen).tolist() for i, _ in reqs]
    params = [SamplingParams(max_tokens=o, ignore_eos=True) for _, o in reqs]
    out_tokens = sum(o for _, o in reqs)
    in_tokens = sum(i for i, _ in reqs)
    spec = preset_variant("triton-paged", max_num_seqs=128, max_num_batched_tokens=8192,
                          cuda_graph_batch_sizes=(1, 2, 4, 8, 16, 32, 48, 64, 96, 128))
    blocks = sum(-(-(i + o) // 16) for i, o in reqs) + 64
    t = time.perf_counter()
    eng = LLMEngine(dataclasses.replace(m.config, num_kv_blocks=blocks, variant=spec), m.loaded)
    eng.generate([prompts[0][:32]], SamplingParams(max_tokens=4, ignore_eos=True))  # prefill kernels JIT
    build = time.perf_counter() - t
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = eng.generate(prompts, params)
    torch.cuda.synchronize()
    ours = time.perf_counter() - t
    assert sum(len(o.token_ids) for o in outs) == out_tokens
    row(f"8B offline, {n} Azure-conv requests (in<=2048, out<=256; {in_tokens} in, {out_tokens} out tokens)",
        f"ours {ours:.1f} s = {out_tokens / ours:,.0f} output tok/s, {(in_tokens + out_tokens) / ours:,.0f} total "
        f"tok/s (engine build + graphs {build:.1f} s, not counted)")
    # transformers: eager batched generate, left-padded batches in trace order, each to its longest output
    hf = m.hf
    t = time.perf_counter()
    with torch.no_grad():
        for s in range(0, n, hf_batch):
            chunk = prompts[s:s + hf_batch]
            width = max(len(p) for p in chunk)
            ids = torch.zeros((len(chunk), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, p in enumerate(chunk):
                ids[j, width - len(p):] = torch.tensor(p)
                mask[j, width - len(p):] = 1
            longest = max(o for _, o in reqs[s:s + hf_batch])
            hf.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=longest, min_new_tokens=longest,
                        do_sample=False, eos_token_id=None, pad_token_id=0, disable_compile=True)
    torch.cuda.synchronize()
    theirs = time.perf_counter() - t
    row(f"8B offline, transformers eager batched generate (batches of {hf_batch}, counted: requested tokens)",
        f"{theirs:.1f} s = {out_tokens / theirs:,.0f} output tok/s")
    row("8B offline throughput, ours / transformers eager", f"{theirs / ours:.2f}x")
    # prefill-heavy MFU: 16 prompts of 2048 tokens, one output token each, 8192-token steps
    cfg = m.mcfg
    n_p, length = 16, 2048
    pp = [torch.randint(0, 128000, (length,), generator=gen).tolist() for _ in range(n_p)]
    eng.generate(pp[:2], SamplingParams(max_tokens=1, ignore_eos=True))
    eng.block_manager.reset_prefix_cache()
    torch.cuda.synchronize()
    t = time.perf_counter()
    eng.generate(pp[2:] + pp[:2], SamplingParams(max_tokens=1, ignore_eos=True))
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    linear = sum(p.numel() for name, p in eng.model.named_parameters() if p.dim() == 2 and "embed" not in name
                 and "lm_head" not in name)
    attn = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * (length * (length + 1) / 2)
    flops = n_p * (2 * linear * length + attn) + n_p * 2 * cfg.vocab_size * cfg.hidden_size
    achieved = flops / dt
    row(f"8B prefill MFU ({n_p} x {length} tokens, 8192-token steps)",
        f"{achieved / 1e12:,.0f} TFLOP/s = {100 * achieved / peak:.0f}% of measured matmul peak, "
        f"{100 * achieved / DATASHEET_BF16:.0f}% of 989 datasheet ({n_p * length / dt:,.0f} tok/s)")
    del eng
    torch.cuda.empty_cache()
