"""SmolLM2 on CPU: our engine's output tokens/s against transformers' batched generate, same requests, same run.

Requests take their input/output lengths from the Azure conversation trace in traces/ (clipped
to fit a CPU); prompts are random token ids of those lengths, so both sides see identical
inputs. Prints figures; asserts nothing about speed.

    python -m bench engine_vs_hf [--trace PATH] [--requests 16] [--max-input 512] [--max-output 64]
"""
from __future__ import annotations

import argparse
import sys
import csv
import json
import os
import platform
import time
from pathlib import Path

import torch

from bench.lib import cli

DEFAULT_TRACE = Path(__file__).resolve().parents[1] / "traces" / "AzureLLMInferenceTrace_conv.csv"


def azure_lengths(path: Path, n: int, max_in: int, max_out: int) -> list[tuple[int, int]]:
    out = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            out.append((max(1, min(int(row["ContextTokens"]), max_in)), max(1, min(int(row["GeneratedTokens"]), max_out))))
            if len(out) == n:
                break
    return out


def add_cli_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-input", type=int, default=512)
    ap.add_argument("--max-output", type=int, default=64)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")


def main(args: argparse.Namespace) -> int | None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

    from transformers import AutoModelForCausalLM

    from engine import EngineConfig, LLMEngine, SamplingParams, VariantSpec, resolve
    from engine.loader.model_source import smollm2_gguf_path

    lengths = azure_lengths(args.trace, args.requests, args.max_input, args.max_output)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 49000, (n_in,), generator=gen).tolist() for n_in, _ in lengths]
    useful = sum(n_out for _, n_out in lengths)

    engine = LLMEngine(EngineConfig(source=resolve("smollm2"), kv_cache_bytes=2 * 1024**3,
                                    variant=VariantSpec(max_num_seqs=64, max_num_batched_tokens=4096)))
    params = [SamplingParams(max_tokens=n_out, ignore_eos=True) for _, n_out in lengths]
    engine.generate([prompts[0][:8]], SamplingParams(max_tokens=2))  # warm-up
    t0 = time.perf_counter()
    ours = engine.generate(prompts, params)
    ours_s = time.perf_counter() - t0
    assert sum(len(o.token_ids) for o in ours) == useful

    path = smollm2_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as batched generation needs
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.no_grad():
        hf.generate(ids[:1, -8:], attention_mask=mask[:1, -8:], max_new_tokens=2, do_sample=False, pad_token_id=0)
        t0 = time.perf_counter()
        hf.generate(ids, attention_mask=mask, max_new_tokens=max(n for _, n in lengths), min_new_tokens=0,
                    do_sample=False, eos_token_id=None, pad_token_id=0)
        hf_s = time.perf_counter() - t0

    figures = {
        "requests": len(prompts), "input_tokens": sum(len(p) for p in prompts), "output_tokens": useful,
        "ours_seconds": round(ours_s, 3), "ours_output_tok_s": round(useful / ours_s, 1),
        "hf_seconds": round(hf_s, 3), "hf_output_tok_s": round(useful / hf_s, 1),
        "ratio": round(hf_s / ours_s, 2), "machine": f"{platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}",
    }
    print(f"{'':24}{'seconds':>10}{'output tok/s':>14}")
    print(f"{'polyinf engine':24}{ours_s:>10.2f}{useful / ours_s:>14.1f}")
    print(f"{'transformers generate':24}{hf_s:>10.2f}{useful / hf_s:>14.1f}")
    print(f"ratio (ours / transformers, output tokens/s): {hf_s / ours_s:.2f}x  "
          f"[{len(prompts)} requests, {figures['input_tokens']} input and {useful} output tokens]")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    sys.exit(cli.run(__doc__, add_cli_args, main))
